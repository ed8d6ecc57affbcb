"""Formation through a store that is not ctrlcomm's: an etcd cluster, or a torch ``Store``
(``TCPStore``) the user already has. Each is adapted to the part of :class:`StoreClient`'s
interface that formation (and ``Group.store``) uses, with the same errors.

Why these two: etcd is the store built to outlive any one process (a cluster, with leases:
the keys a process sets expire once it is gone and stops renewing them), and torch's
TCPStore (its libuv server) is what torch itself forms 100k-rank jobs through; a job that has
one up already need not start another. etcd is reached through its JSON gateway with
``etcd3gw`` (OpenStack's client: plain HTTP, no gRPC stack to build), waits are looked at
again and again, backing off to :data:`POLL_MAX_S`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from .._errors import InvalidArgumentError, StoreError, StoreKeyError, StoreTimeoutError
from ._client import port_arg

POLL_MIN_S, POLL_MAX_S = 0.002, 0.05  # a wait looks again after this, doubling, at most
LEASE_TTL_S = 10  # an etcd client's keys outlive its process by this at most
HTTP_TIMEOUT_S = 5.0  # an etcd request's deadline
TXN_OPS = 100  # reads per etcd transaction (etcd refuses more than 128 by default)


def _b(v: str | bytes) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)


class _Polled:
    """What formation asks of a store, over a few primitives a subclass gives: waits are
    looks repeated until a deadline (backing off), never a spin."""

    host: str
    port: int
    keyed = False  # (no ctrlcomm key: its own access control is the store's)
    what = "store"

    def __init__(self, prefix: str, timeout: float) -> None:
        self.prefix, self.timeout = prefix, timeout

    # -- primitives
    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        raise NotImplementedError

    def _put(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def _put_if_absent(self, key: str, value: bytes) -> bytes | None:
        """None where it was set; else the value held."""
        raise NotImplementedError

    def _add(self, key: str, amount: int) -> int:
        raise NotImplementedError

    def _delete(self, key: str) -> bool:
        raise NotImplementedError

    def _delete_prefix(self, prefix: str) -> int:
        raise NotImplementedError

    def close(self) -> None:
        pass

    # -- StoreClient's interface
    def _k(self, key: str | bytes) -> str:
        return self.prefix + (key.decode() if isinstance(key, bytes) else key)

    def _t(self, timeout: Any) -> float:
        if timeout is None:
            return self.timeout
        return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (StoreError, InvalidArgumentError):
            raise
        except Exception as e:  # (the client's own: a connection refused, an HTTP error...)
            raise StoreError(f"{self.what}: {type(e).__name__}: {e}") from None

    def multi_get(self, keys: Sequence[str | bytes], *, wait: bool = True,
                  timeout: Any = None) -> list[bytes]:
        ks = [self._k(k) for k in keys]
        end = time.monotonic() + self._t(timeout)
        pause = POLL_MIN_S
        while True:
            got = self._call(self._get_many, ks)
            missing = [k[len(self.prefix):] for k, v in zip(ks, got, strict=True) if v is None]
            if not missing:
                return got  # type: ignore[no-any-return]
            if not wait:
                raise StoreKeyError(missing[0] if len(missing) == 1 else missing)
            left = end - time.monotonic()
            if left <= 0:
                raise StoreTimeoutError(f"{self.what}: wait timed out; missing keys {missing}")
            time.sleep(min(pause, left))
            pause = min(pause * 2, POLL_MAX_S)

    def get(self, key: str | bytes, *, wait: bool = True, timeout: Any = None) -> bytes:
        return self.multi_get([key], wait=wait, timeout=timeout)[0]

    def wait(self, keys: Sequence[str | bytes], timeout: Any = None) -> None:
        self.multi_get(keys, timeout=timeout)

    def exists(self, keys: Sequence[str | bytes], *, timeout: Any = None) -> list[bool]:
        return [v is not None for v in self._call(self._get_many, [self._k(k) for k in keys])]

    def check(self, keys: Sequence[str | bytes], *, timeout: Any = None) -> bool:
        return all(self.exists(keys))

    def set(self, key: str | bytes, value: str | bytes, *, timeout: Any = None) -> None:
        self._call(self._put, self._k(key), _b(value))

    def multi_set(self, keys: Sequence[str | bytes], values: Sequence[str | bytes], *,
                  timeout: Any = None) -> None:
        for k, v in zip(keys, values, strict=True):
            self.set(k, v)

    def set_if_absent(self, key: str | bytes, value: str | bytes, *, timeout: Any = None
                      ) -> tuple[bool, bytes]:
        held = self._call(self._put_if_absent, self._k(key), _b(value))
        return (True, _b(value)) if held is None else (False, held)

    def add(self, key: str | bytes, amount: int, *, timeout: Any = None) -> int:
        return int(self._call(self._add, self._k(key), int(amount)))

    def delete(self, key: str | bytes, *, timeout: Any = None) -> bool:
        return bool(self._call(self._delete, self._k(key)))

    delete_key = delete

    def multi_delete(self, keys: Sequence[str | bytes], *, timeout: Any = None) -> int:
        return sum(self.delete(k) for k in keys)

    def delete_prefix(self, prefix: str | bytes, *, timeout: Any = None) -> int:
        return int(self._call(self._delete_prefix, self._k(prefix)))

    def ping(self, *, timeout: Any = None) -> None:
        self.exists(["ctrlcomm:ping"])

    def set_timeout(self, timeout: Any) -> None:
        self.timeout = self._t(timeout)

    def __enter__(self) -> _Polled:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EtcdStore(_Polled):
    """An etcd cluster's key space under ``prefix``, every key set on a lease of this
    client's that a thread renews (``LEASE_TTL_S``): what a process set goes once it is gone
    (or closed this client, which revokes it)."""

    def __init__(self, url: str, prefix: str, timeout: float) -> None:
        try:
            from etcd3gw.client import Etcd3Client
        except ImportError:
            raise InvalidArgumentError(f"store={url!r} needs etcd's client: pip install "
                                       "'ctrlcomm[etcd]'") from None
        parts = urlsplit(url)
        if parts.scheme != "etcd" or not parts.hostname:
            raise InvalidArgumentError(f"store={url!r}: give etcd://HOST:PORT/PREFIX")
        self.host = parts.hostname
        self.port = port_arg(parts.port or 2379, "store: port")
        root = parts.path.strip("/")
        super().__init__(f"{root}/{prefix}" if root else prefix, timeout)
        self.what = f"etcd at {self.host}:{self.port}"
        # (each request is short, a wait being looks repeated: a request that takes longer
        # than HTTP_TIMEOUT_S finds etcd gone, not busy)
        self._c = Etcd3Client(host=self.host, port=self.port, timeout=HTTP_TIMEOUT_S)
        self._closed = threading.Event()
        self._lease = self._call(self._c.lease, LEASE_TTL_S)
        self._renewer = threading.Thread(target=self._renew, daemon=True,
                                         name="ctrlcomm-etcd-lease")
        self._renewer.start()

    def _renew(self) -> None:
        while not self._closed.wait(LEASE_TTL_S / 3):
            try:
                if self._lease.refresh() < 0:  # expired (etcd was away): its keys went;
                    # a new one for what is set from now on
                    self._lease = self._c.lease(LEASE_TTL_S)
            except Exception:  # noqa: BLE001  (etcd away a moment: the next renewal may do)
                continue

    def _txn(self, compare: list[Any], success: list[Any], failure: list[Any] | None = None
             ) -> Any:
        return self._c.transaction({"compare": compare, "success": success,
                                    "failure": failure or []})

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        from etcd3gw.utils import _decode, _encode

        out: list[bytes | None] = []
        for i in range(0, len(keys), TXN_OPS):  # (etcd takes 128 operations a transaction)
            res = self._txn([], [{"request_range": {"key": _encode(k)}}
                                 for k in keys[i:i + TXN_OPS]])
            for r in res.get("responses", []):
                kvs = r.get("response_range", {}).get("kvs", [])
                out.append(_decode(kvs[0].get("value", "")) if kvs else None)
        return out

    def _put(self, key: str, value: bytes) -> None:
        self._c.put(key, value, lease=self._lease)

    def _put_if_absent(self, key: str, value: bytes) -> bytes | None:
        from etcd3gw.utils import _decode, _encode

        k = _encode(key)
        res = self._txn([{"key": k, "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
                        [{"request_put": {"key": k, "value": _encode(value),
                                          "lease": self._lease.id}}],
                        [{"request_range": {"key": k}}])
        if res.get("succeeded"):
            return None
        kvs = res["responses"][0].get("response_range", {}).get("kvs", [])
        return _decode(kvs[0].get("value", "")) if kvs else b""

    def _add(self, key: str, amount: int) -> int:
        from etcd3gw.utils import _decode, _encode

        k = _encode(key)
        while True:  # (compare and swap on the key's revision: etcd has no counter)
            res = self._txn([], [{"request_range": {"key": k}}])
            kvs = res["responses"][0].get("response_range", {}).get("kvs", [])
            now = int(_decode(kvs[0].get("value", "")) or b"0") if kvs else 0
            rev = int(kvs[0].get("mod_revision", 0)) if kvs else 0
            cmp = {"key": k, "result": "EQUAL", "target": "MOD", "mod_revision": rev} if kvs \
                else {"key": k, "result": "EQUAL", "target": "CREATE", "create_revision": 0}
            new = now + amount
            # (no lease: a counter is the group's, which another process (a grow's next
            # ticket) counts on after this one has closed)
            if self._txn([cmp], [{"request_put": {"key": k, "value": _encode(str(new))}}]
                         ).get("succeeded"):
                return new

    def _delete(self, key: str) -> bool:
        return bool(self._c.delete(key))

    def _delete_prefix(self, prefix: str) -> int:
        return int(bool(self._c.delete_prefix(prefix)))

    leased = True  # (its keys go as it closes: none to delete first)

    def close(self) -> None:
        """Revoke the lease, which deletes this client's keys: in a thread, so that a close
        never waits for an etcd that is gone (they expire then)."""
        if self._closed.is_set():
            return
        self._closed.set()
        threading.Thread(target=self._revoke, daemon=True, name="ctrlcomm-etcd-close").start()

    def _revoke(self) -> None:
        try:
            self._lease.revoke()
        except Exception:  # noqa: BLE001  (etcd gone: they expire)
            pass


class TorchStore(_Polled):
    """A torch ``Store`` (a ``TCPStore``...) under ``prefix``. torch's stores have no
    leases: what a process that died set stays until formation deletes it (each formation
    deletes its keys as it settles)."""

    def __init__(self, store: Any, prefix: str, timeout: float) -> None:
        super().__init__(prefix, timeout)
        self._s = store
        self.host, self.port = torch_store_address(store)
        self.what = f"torch store {type(store).__name__}"
        self._lock = threading.Lock()  # (a torch store is not for threads at once)

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        with self._lock:
            return [bytes(self._s.get(k)) if self._s.check([k]) else None for k in keys]

    def _put(self, key: str, value: bytes) -> None:
        with self._lock:
            self._s.set(key, value)

    def _put_if_absent(self, key: str, value: bytes) -> bytes | None:
        with self._lock:
            # (compare_set with "" expected sets an absent key; it returns the value held
            # after: this one's where it was set, an address line being unique)
            held = bytes(self._s.compare_set(key, "", value))
        return None if held == value else held

    def _add(self, key: str, amount: int) -> int:
        with self._lock:
            return int(self._s.add(key, amount))

    def _delete(self, key: str) -> bool:
        with self._lock:
            return bool(self._s.delete_key(key))

    def _delete_prefix(self, prefix: str) -> int:
        # (torch's stores cannot list keys: what formation deletes by prefix, a failed
        # try's secrets, is each deleted by the rank that reads it, or stays)
        return 0


def torch_store_address(store: Any) -> tuple[str, int]:
    """A torch store's server address: its own (a TCPStore's), or that of the store it wraps
    (a PrefixStore's ``underlying_store``); ("127.0.0.1", 1) where none says."""
    for _ in range(8):
        if getattr(store, "host", None):
            return str(store.host), int(getattr(store, "port", 0) or 1)
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            break
        store = inner
    return "127.0.0.1", 1


def open_external(store: Any, name: str, timeout: float) -> _Polled:
    """The store given as ``store=``: an ``etcd://`` URL, or a torch store object."""
    prefix = f"ctrlcomm/{name}/"
    if isinstance(store, str):
        return EtcdStore(store, prefix, timeout)
    if all(hasattr(store, m) for m in ("compare_set", "add", "get", "set", "check",
                                       "delete_key")):
        return TorchStore(store, prefix, timeout)
    raise InvalidArgumentError(f"store= must be an etcd://HOST:PORT/PREFIX URL or a torch "
                               f"Store (a TCPStore), got {type(store).__name__}")
