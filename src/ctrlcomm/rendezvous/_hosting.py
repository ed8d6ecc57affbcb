"""The stores this process serves for the groups it forms (rank 0's, by default): one per
address, shared by the groups formed through it, and kept a few seconds after the last is
closed (a group formed right after, on the same port, finds it still there)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from .._errors import (
    InvalidArgumentError,
)
from ..rendezvous._server import StoreServer
from ..rendezvous._state import StoreLimits

_servers: dict[tuple[str, int], list[Any]] = {}  # (host, port) -> [server, refcount]
_servers_lock = threading.Lock()


def _acquire_server(host: str, port: int, key: bytes | None = None,
                    encrypt: bool = False, limits: StoreLimits | None = None) -> StoreServer:
    with _servers_lock:
        entry = _servers.get((host, port))
        if entry is not None and entry[0].pid == os.getpid():
            srv = entry[0]
            if (srv.key or None, srv.encrypt) != (key or None, encrypt):
                raise InvalidArgumentError(
                    f"the store this process serves on {host}:{port} runs with another "
                    "auth_key or encryption setting than this group asks for")
            entry[1] += 1
            _idle.pop((host, port), None)
            return srv  # type: ignore[no-any-return]
        srv = StoreServer(host, port, auth_key=key, encrypt=encrypt, limits=limits)
        srv.pid = os.getpid()  # type: ignore[attr-defined]
        _servers[(host, srv.port)] = [srv, 1]  # (port 0: the one the OS picked)
        return srv


# An embedded store outlives the last group that uses it by this long: other ranks may still
# be talking to it (forming the next group of the same name, say), and a group formed again
# here in the meantime reuses it instead of starting an empty store on the same port.
STORE_KEEPALIVE_S = 5.0


def _release_server(host: str, port: int) -> None:
    global _reaper
    with _servers_lock:
        entry = _servers.get((host, port))
        if entry is None or entry[0].pid != os.getpid():  # (a forked child's: the parent's)
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        _idle[(host, port)] = time.monotonic() + STORE_KEEPALIVE_S
        if _reaper is None or not _reaper.is_alive():
            # one thread closes idle stores, and exits when none is left
            _reaper = threading.Thread(target=_reap, name="ctrlcomm-store-reaper", daemon=True)
            _reaper.start()


_idle: dict[tuple[str, int], float] = {}  # embedded stores no group uses, and when to close
_reaper: threading.Thread | None = None


def _reap() -> None:
    while True:
        with _servers_lock:
            now = time.monotonic()
            due = [k for k, t in _idle.items() if t <= now]
            closing = []
            for k in due:
                del _idle[k]
                entry = _servers.get(k)
                if entry is not None and entry[1] <= 0:
                    del _servers[k]
                    closing.append(entry[0])
            nxt = min(_idle.values(), default=None)
        for srv in closing:
            srv.close()
        if nxt is None:
            return
        time.sleep(max(nxt - time.monotonic(), 0.01))
