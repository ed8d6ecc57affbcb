"""Groups: formation through the store, and the blocking and asyncio views.

Every call is described once by a ``_spec_*`` function (validation, plan, op code, result
post-processing); :class:`Group` runs it with the blocking driver and :class:`AioGroup` with the
asyncio driver. Both views share one :class:`ctrlcomm._core.Core`, hence one sequence counter.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from . import _ops
from ._aio import _Awaited, _coroutine_function, run_async
from ._calls import (
    LIVENESS_TIMEOUT_S,
    _barrier_call,
    _env_seconds,
    _p2p_args,
    _run_async,
    _run_sync,
    _seconds,
    _spec_all_gather,
    _spec_all_reduce,
    _spec_all_to_all,
    _spec_broadcast,
    _spec_gather,
    _spec_reduce,
    _spec_scatter,
    _timeout_arg,
    _validate_world,
)
from ._core import Core, flight_record_size
from ._drivers import run_sync
from ._endpoint import Endpoint
from ._errors import (
    FormationError,
    FormationStoreTimeoutError,
    FormationTimeoutError,
    InvalidArgumentError,
    StoreError,
    StoreTimeoutError,
    show,
)
from ._forming import (
    CODECS,
    Made,
    Parts,
    _address_record,
    _make_core,
    _new_parts,
    _Setup,
    shrink_plan,
    split_begin,
    split_end,
)
from ._lifecycle import CLOSED
from .rendezvous._client import StoreClient, _check_host, _store_host, port_arg
from .rendezvous._external import open_external, torch_store_address
from .rendezvous._formation import (
    FORMED,
    _bind_address,
    _formed_without,
    _group_id,
    _rendezvous,
    tell_bind_failure,
)
from .rendezvous._hosting import _acquire_server, _release_server
from .rendezvous._server import StoreServer
from .rendezvous._state import StoreLimits
from .transport import TRANSPORTS
from .transport._heartbeat import Heartbeat
from .transport._net import (
    _wildcard,
    auth_key_or_env,
    curve_available,
    local_address_for,
    warn_if_unkeyed,
)
from .transport._shm import spin_budget
from .transport._tcp import BEFORE_EXIT_FLUSH

CLOSE_ASK_S = 0.1  # how long close() waits for the store to take the group's table back
log = logging.getLogger("ctrlcomm")


# ------------------------------------------------------------------------ store hosting

# The groups formed through another store (from_env: torchrun's agent store), per key (a
# name's), in this process: the ranks form them in the same order, so the n-th of a name
# finds the n-th store address.
# Counted once formed: a try again after a failure (rank 0's: on a new port) publishes its
# address under the same number, where a rank coming late finds it.
_agent_formed: dict[str, int] = {}


def _through_agent_store(cls: type[Group], host: str, port: int, rank: int, size: int,
                         kwargs: dict[str, Any]) -> Group:
    """:meth:`Group.from_env` under torchrun, whose agent's TCPStore holds ``port``: rank 0
    hosts ctrlcomm's store on a free port and publishes its address in the agent's store;
    the others read it there, then all form the group as usual (within one deadline)."""
    rank, size = _validate_world(rank, size)
    name = kwargs.get("name", "default")
    t = _timeout_arg(kwargs.get("timeout", 300.0), "Group.from_env")
    if t is None or not isinstance(name, str):
        return cls.create(host, port, rank, size, **kwargs)  # (which says what is wrong)
    try:
        from datetime import timedelta

        from torch.distributed import TCPStore  # type: ignore[attr-defined]
    except ImportError:
        raise InvalidArgumentError(
            "Group.from_env under torchrun: its agent's store holds MASTER_PORT, and reaching "
            "it needs torch; set CTRLCOMM_PORT to a free port") from None
    deadline = time.monotonic() + t
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"ctrlcomm/attempt_{restart}/{name}"
    try:  # (the agent's host: a name looked up within formation's deadline; torch has none)
        agent_address = _store_host(host, port, deadline - time.monotonic())
    except StoreTimeoutError as e:
        raise FormationStoreTimeoutError(f"group {name!r} not formed within the timeout on "
                                         f"rank {rank}: torchrun's agent store: {e}") from None
    try:
        agent = TCPStore(agent_address, port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    except Exception as e:  # (torch's DistNetworkError, RuntimeError...)
        raise StoreError(f"Group.from_env under torchrun: cannot reach its agent's store at "
                         f"{host}:{port}: {type(e).__name__}: {e}") from None
    try:
        return _through_store(cls, agent, key, agent_address, port, rank, size, kwargs,
                              deadline, f"torchrun's agent store at {host}:{port}")
    finally:
        del agent


def _through_store(cls: type[Group], agent: Any, key: str, near: str, near_port: int,
                   rank: int, size: int, kwargs: dict[str, Any], deadline: float,
                   what: str) -> Group:
    """Form the group through ``agent``, a store of torch's (or ctrlcomm's client: ``set``,
    ``get``, ``set_timeout``, ``delete_key``) that every rank reaches: rank 0 hosts
    ctrlcomm's store on a free port of the address it reaches ``near`` from and publishes
    that address at ``key``; the others read it there; then all form the group as usual,
    within ``deadline``. ``what`` names ``agent`` in errors."""
    name = kwargs.get("name", "default")
    base = key
    n = _agent_formed.get(base, 0)
    key = f"{base}/{n}/store"
    if rank == 0:
        srv = _acquire_server(local_address_for(near, near_port), 0,
                              auth_key_or_env(kwargs.get("auth_key") or None),
                              bool(kwargs.get("encrypt", False)))
        _release_server(srv.host, srv.port)  # (create takes it up; closed if unused)
        address = f"{srv.host} {srv.port}"
        agent.set(key, address)
    else:
        found = _published(agent, key, _agent_tried.get((key, n)), deadline)
        if found is None:
            raise FormationTimeoutError(
                f"group {name!r} not formed within the timeout on rank {rank}: rank 0 did "
                f"not publish its store's address in {what} (is rank 0 alive?)", missing=[0])
        address = found
    store_host, _, p = address.rpartition(" ")
    try:
        g = cls.create(store_host, int(p), rank, size, **kwargs, _deadline=deadline)
    except BaseException:
        # a try again must not find this try's address: rank 0 takes it back; the
        # others remember it, and wait for another
        if rank == 0:
            try:
                agent.delete_key(key)
            except Exception:  # noqa: BLE001  (best effort: the agent may be gone)
                pass
        else:
            _agent_tried[(key, n)] = address
        raise
    _agent_formed[base] = n + 1
    return g


# (name, number) -> the address a failed try of this process read there (see above)
_agent_tried: dict[tuple[str, int], str] = {}


def _published(agent: Any, key: str, tried: str | None, deadline: float) -> str | None:
    """The store address rank 0 published at ``key`` in the agent's store, other than
    ``tried``: waited for until ``deadline``; None if none came."""
    from datetime import timedelta

    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            agent.set_timeout(timedelta(seconds=left))
            address = agent.get(key).decode()
        except StoreTimeoutError:
            return None
        except StoreError:  # (ctrlcomm's client, told why: a store with a key it lacks, say)
            raise
        except Exception:  # (torch's DistStoreError: a timeout, or the agent gone)
            return None
        if address != tried:
            return str(address)
        time.sleep(0.05)


# ------------------------------------------------------------------------------- groups



def _formation_settings(name: Any, timeout: Any, transport: Any, codec: Any, port: Any,
                        auth_key: Any, encrypt: Any, external: bool = False
                        ) -> tuple[float, str, int, bytes | None, bool]:
    """Group.create's settings checked, in this order: (timeout, transport, port, key,
    encrypt)."""
    if not isinstance(name, str) or not name or "/" in name or "\n" in name:
        raise InvalidArgumentError(f"group name must be a non-empty str without '/' or "
                                   f"newlines, got {name!r}")
    t = _timeout_arg(timeout, "Group.create")
    if t is None:
        raise InvalidArgumentError("Group.create: timeout must be > 0 seconds (formation's "
                                   "deadline and every call's default), got None")
    if transport is None:
        # (the variable also reaches groups made for you: StatelessProcessGroup, ...;
        # not encrypted ones, which only "zmq" can carry)
        env = os.environ.get("CTRLCOMM_TRANSPORT") or None
        if env is not None and env not in TRANSPORTS:
            raise InvalidArgumentError(f"CTRLCOMM_TRANSPORT={env!r} names no transport; "
                                       "use 'shm', 'tcp' or 'zmq'")
        transport = "zmq" if encrypt else (env or "shm")
    if transport not in TRANSPORTS:
        raise InvalidArgumentError(f"unknown transport {transport!r}; use 'shm', 'tcp' or "
                                   "'zmq'")
    if codec not in CODECS:
        raise InvalidArgumentError(f"unknown codec {codec!r}; use one of {sorted(CODECS)}")
    flight_record_size()  # (read again as the core is made: a bad value fails it before)
    port = port_arg(port)
    if auth_key is not None and not auth_key:  # (given, but empty: a key read from an
        # empty file, say; an empty CTRLCOMM_AUTH_KEY is unset, as shells have it)
        raise InvalidArgumentError("Group.create: auth_key is empty; give a secret, or "
                                   "None for no authentication")
    key = auth_key_or_env(auth_key)
    if external and not key:
        raise InvalidArgumentError(
            "Group.create: store= needs auth_key= (or CTRLCOMM_AUTH_KEY): whoever reaches an "
            "external store can read what formation keeps there, the group's secret "
            "included, which the key makes useless to them")
    encrypt = bool(encrypt)
    if encrypt:
        if not key:
            raise InvalidArgumentError(
                "encrypt=True needs auth_key= (or CTRLCOMM_AUTH_KEY): encryption keys are "
                "exchanged through the authenticated store")
        if transport != "zmq":
            raise InvalidArgumentError(
                f"encrypt=True runs over ZeroMQ (CurveZMQ); transport={transport!r} "
                "cannot encrypt: use transport='zmq' or leave it unset")
        if not curve_available():
            raise InvalidArgumentError(
                "encrypt=True: this pyzmq's libzmq was built without CURVE support")
    return t, transport, port, key, encrypt


class _Joining(NamedTuple):
    """What Group.create has made when this rank joins the formation (see _form_core)."""

    store: StoreClient
    server: StoreServer | None
    s: _Setup
    ep: Endpoint
    hb: Heartbeat
    rank: int
    world_size: int
    name: str
    deadline: float
    rank0_hosts: bool
    # what the store here had dropped as this rank made it: counted from then, not from the
    # rendezvous (a peer without the key may fail its handshake as it connects, and where
    # its ZeroMQ saw the mechanisms differ first, it tries no more until its next request)
    dropped: int
    late_check: bool = True


def _form_core(j: _Joining) -> Core:
    """Publish this rank's address record, take part in the formation, and make the core
    over the endpoint and heartbeat (peers set, MAC key derived)."""
    me = _address_record(j.ep, j.hb, j.s, j.world_size)
    try:
        nonce, secret, table = _rendezvous(j.store, me, j.rank, j.world_size, j.name,
                                           j.deadline, rank0_hosts=j.rank0_hosts,
                                           late_check=j.late_check)
    except FormationTimeoutError as e:
        _explain_timeout(e, j)
        raise
    return _make_core(j.s, j.ep, j.hb, j.rank, j.world_size, j.name, nonce, secret, table)


def _explain_timeout(e: FormationTimeoutError, j: _Joining) -> None:
    """What a formation that timed out adds to its error, where the store here can tell."""
    server, dropped = j.server, j.dropped
    if server is not None and server.dropped > dropped and e.args:
        # what a rank with another auth_key (or none) sent: it waits, unanswered
        e.args = (f"{e.args[0]} (the store here dropped "
                  f"{server.dropped - dropped} requests or connections it could "
                  "not authenticate meanwhile: is a rank created with another "
                  "auth_key, or none?)",)
    if server is not None and e.missing and e.args \
            and ipaddress.ip_address(j.s.store_address).is_loopback:
        # (vLLM's TCPStore listens on every interface whatever its host: a rank
        # 0 given 127.0.0.1 there reaches ranks given this host's address)
        e.args = (f"{e.args[0]} (if they run on other hosts: the store here "
                  f"listens on the loopback address {j.s.store_address} only, which "
                  "they cannot reach; give rank 0 an address of this host that "
                  "they reach, or '0.0.0.0')",)


# Where a group that grows (Group.grow) tells the processes that join (Group.join) how:
# "TOKEN OLD NEW" (the try's own token, the old and the new world size), under its name
GROW = "ctrlcomm:grow"


def _external_address(store: Any, host: Any, port: Any, host_store: Any
                      ) -> tuple[Any, Any, bool | None]:
    """(Group.create.) ``(host, port, host_store)``: as given; with ``store=``, the store's
    host and port (by which this rank picks the interface it publishes), and no store
    hosted here."""
    if store is None:
        return host, port, host_store
    if host is not None or port is not None or host_store:
        raise InvalidArgumentError("Group.create: with store=, the store's address is in it: "
                                   "give host and port as None (and no host_store)")
    if isinstance(store, str):
        parts = urlsplit(store)
        try:
            return parts.hostname or "", parts.port or 2379, False
        except ValueError:
            raise InvalidArgumentError(f"store={store!r}: give etcd://HOST:PORT/PREFIX") \
                from None
    return (*torch_store_address(store), False)


def _group_store(host: Any, port: Any, name: str | None, key: bytes | None, encrypt: bool,
                 timeout: float, external: Any = None, address: str | None = None) -> Any:
    """A new client of the store of group ``name`` (its keys; None: the whole store):
    ``external``'s (an etcd URL or a torch Store) where given, else the ctrlcomm store at
    ``(host, port)`` (``address``: the host's address, where it was looked up)."""
    if external is not None:
        return open_external(external, name or "", timeout)
    return StoreClient(host, port, timeout=timeout,
                       prefix=f"ctrlcomm/{name}/" if name is not None else "", auth_key=key,
                       encrypt=encrypt, _address=address)


def _open_store(s: _Setup, name: str) -> Any:
    """A new client of the store of a group made with ``s`` (its name's keys)."""
    return _group_store(s.store_host, s.port, name, s.key, s.encrypt, s.timeout, s.external,
                        s.store_address)


def _formed_elsewhere(host: str, address: str, port: int, key: bytes | None, encrypt: bool,
                      rank: int, name: str, deadline: float, why: str) -> None:
    """(Rank 0's store could not bind ``port``: ``why``.) Raise FormationError where the
    store at ``(address, port)`` holds group ``name`` formed without this process (see
    _formed_without); else leave ``why`` there for the ranks that wait for rank 0 there
    (tell_bind_failure; where it is a store of ours that takes this rank's key)."""
    try:
        with _group_store(host, port, name, key, encrypt, 1.0, address=address) as store:
            _formed_without(store, rank, name, deadline)
            tell_bind_failure(store, why, deadline)
    except (StoreError, OSError):
        pass


async def _in_thread(make: Callable[[], Group]) -> Group:
    """``make()`` (a formation) in the running loop's executor; the group it makes once the
    awaiting task was cancelled is closed."""
    fut = asyncio.get_running_loop().run_in_executor(None, make)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(_close_formed)
        raise


def _close_formed(fut: asyncio.Future[Group]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        fut.result().close()


def _answers(s: _Setup) -> bool:
    """Whether a store answers at the address of the store of a group made with ``s``."""
    try:
        with _group_store(s.store_host, s.port, None, s.key, s.encrypt, 1.0,
                          address=s.store_address) as store:
            store.ping()
        return True
    except (StoreError, OSError):
        return False


def _grow(g: Group, size: int, deadline: float) -> Group:
    """(Group.grow, the ranks agreed.) Form the grown group through the group's store."""
    c, s = g._core, g._setup
    store = _open_store(s, c.name)
    parts = None
    try:
        if c.rank == 0:
            store.set(GROW, f"{os.urandom(6).hex()} {c.size} {size}",
                      timeout=max(deadline - time.monotonic(), 0.001))
        parts = Parts(s, size)
        core = _form_core(_Joining(store, None, s, parts.ep, parts.hb, c.rank, size, c.name,
                                   deadline, False, 0, late_check=False))
        parts.ep = parts.hb = None  # type: ignore[assignment]  # (the core's now)
        if c.rank == 0:
            try:  # (the next process to join waits for the next grow)
                store.delete(GROW, timeout=CLOSE_ASK_S)
            except StoreError:
                pass
    except BaseException:
        if parts is not None:
            parts.close()
        if c.rank == 0:
            try:  # (a process that joins later must not take a ticket of this failed try)
                store.delete(GROW, timeout=CLOSE_ASK_S)
            except (StoreError, OSError):
                pass
        store.close()
        raise
    new = type(g)(core, store=store, server=None, server_key=None)
    new._setup = s
    return new


class Group:
    """A group of ranks with object collectives and point-to-point messages.

    Made with :meth:`create` (or :meth:`from_env`), never global: a process may hold several
    groups, overlapping or nested. All ranks call collectives in the same order. Every call
    takes ``timeout=`` in seconds (the group's default otherwise).

    Failure semantics (what a failed call leaves behind): a bad argument raises
    :class:`InvalidArgumentError` before anything is sent, and the group still works; a failed
    reduction raises :class:`ReductionError` on every rank and the group still works; a
    timeout, mismatch, lost peer, abort or cancelled awaited collective leaves the group
    *broken*: every later call raises :class:`GroupBrokenError` naming the first cause. A
    ``recv`` that times out or is cancelled leaves the group working.

    The blocking methods run in the caller's thread; ``group.aio`` offers the same methods as
    coroutines, driven by the running event loop. Both share one sequence counter, so blocking
    and awaited calls may be mixed.

    Point-to-point calls run at once, from any number of tasks and threads (full duplex):
    sends never wait for a receive, receives of different ``(src, tag)`` wait independently,
    and receives of one ``(src, tag)`` take its messages in the order they were called. A
    collective runs while they wait. Collectives run one at a time: awaited collectives of
    one event loop take turns, first come first (``asyncio.gather`` of several, one per
    task, runs them in the order their tasks started, on every rank); a collective of
    another thread while one is in progress raises :class:`ConcurrentUseError` at once (two
    threads' collectives could pair in a different order on another rank).
    """

    _finalizer: weakref.finalize[Any, Any] | None = None
    _setup: _Setup  # (what its ranks were made with: groups made from it are too)
    #: Where this group was made from another (split, new_group, shrink, grow): the rank in
    #: that group of each of its ranks (None for a rank that was not in it); else None.
    parent_ranks: list[int | None] | None = None
    _shrinks = 0  # (shrinks begun: a failed one's messages are passed over by the next)

    def __init__(self, core: Core, *, store: StoreClient | None, server: StoreServer | None,
                 server_key: tuple[str, int] | None) -> None:
        self._core = core
        self.store = store
        self._server = server
        self._aio: weakref.ref[AioGroup] | None = None
        self._keep_server(server_key)
        _all_groups.add(self)

    def _keep_server(self, server_key: tuple[str, int] | None) -> None:
        """Hold the embedded store ``server_key`` names (taken with :func:`_acquire_server`;
        None: none) until this group is closed or dropped. A group dropped without close()
        (vLLM's StatelessProcessGroup has none) is closed once collected: its heartbeat
        thread, sockets and store port are not kept for ever. (Group.from_torch's leader
        calls it again, with the store it served the group's formation from.)"""
        if self._finalizer is not None:
            self._finalizer.detach()
        self._server_key = server_key
        self._finalizer = close_when_dropped(self, _close_parts, self._core, self.store,
                                             server_key)

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(
        cls,
        host: str | None,
        port: int | None,
        rank: int,
        world_size: int,
        *,
        name: str = "default",
        timeout: float = 300.0,
        host_store: bool | None = None,
        bind_host: str | None = None,
        codec: str = "pickle",
        auth_key: bytes | str | None = None,
        transport: str | None = None,
        zmq_context: Any = None,
        heartbeat_interval: float = 1.0,
        liveness_timeout: float | None = LIVENESS_TIMEOUT_S,
        encrypt: bool = False,
        store_limits: StoreLimits | None = None,
        spin_us: float | None = None,
        store: Any = None,
        _deadline: float | None = None,
        _late_check: bool = True,
    ) -> Group:
        """Form a group through the store at ``(host, port)``.

        Args:
            host: the store's address (None with ``store=``). By default rank 0 hosts the
                store there.
                ``"0.0.0.0"`` (or ``"::"``, on the store's host): the store, and the ranks
                given it, listen on every interface, and ranks on other hosts, given an
                address of that host, reach them there (as TRL's vLLM workers and trainer do).
            port: the store's port (None with ``store=``).
            rank: this process's rank, ``0 <= rank < world_size``.
            world_size: number of ranks.
            name: the group's name; several groups can share one store under distinct names.
            timeout: default deadline of every call, and of formation, in seconds.
            host_store: whether this rank hosts the store (default: rank 0 does).
            bind_host: the address to bind this rank's socket to (default: the interface
                this machine uses to reach ``host``; ``"0.0.0.0"`` is an explicit opt-in).
            codec: ``"pickle"`` (default) or ``"msgpack"`` (data only, never unpickles).
            auth_key: a shared secret (default: ``CTRLCOMM_AUTH_KEY`` from the environment).
                Without one, every frame and heartbeat is still authenticated (a MAC over
                header and payload, checked before anything is decoded) with a secret rank
                0 makes at formation and the store gives only to the ranks that joined;
                with one, the store and formation are too (a stranger cannot join in a
                rank's place, nor learn the secret by reading the network as the group
                forms). See the README's threat model.
            transport: ``"shm"`` (default without ``encrypt``: shared memory to the ranks
                of this host, user and IPC namespace, handed over on a Unix socket, and
                plain TCP sockets to the others, lowest latency), ``"tcp"`` (sockets only)
                or ``"zmq"`` (ZeroMQ PUSH/PULL sockets; the default with ``encrypt``);
                ``None``: ``CTRLCOMM_TRANSPORT`` where it is set, which also reaches groups
                made for you (``StatelessProcessGroup``...). A send on "shm" or "tcp" with
                more than 4 MiB queued for a peer returns once that peer has taken all but
                4 MiB (the sender's process writes it); on "zmq" it returns at once
                (ZeroMQ's I/O thread writes it).
            zmq_context: with ``transport="zmq"``, the ZeroMQ context to make sockets from.
            heartbeat_interval: seconds between this rank's heartbeats to its peers.
            liveness_timeout: a peer silent this long (stopped, hung, cut off) is declared
                lost by the ranks waiting for it; ``None`` turns liveness checks off. A peer
                that dies is noticed sooner, from its closed connection. Heartbeats are sent
                by a thread, so a rank whose main thread holds the GIL longer than this (one
                long C call) falls silent too: a peer on this host (same kernel, network and
                PID namespace) is then looked up in ``/proc`` and, while its process runs,
                waited for up to twelve times this (within the call's deadline); one on
                another host is lost (set this above your longest GIL-holding call there).
                The default is 5 s, or
                ``CTRLCOMM_LIVENESS_TIMEOUT`` (seconds, or ``none``) where it is set, which
                also reaches groups made for you (``StatelessProcessGroup``,
                ``AsyncZMQCommunicator``).
            encrypt: encrypt all group and store traffic with CurveZMQ, for untrusted
                networks. Needs ``auth_key`` and ZeroMQ: each rank makes a key pair and
                publishes its public key in the authenticated address table; the store's
                key pair is derived from ``auth_key`` (so an external store runs with
                ``ctrlcomm store --encrypt``). Heartbeats stay plain (MAC'd group id,
                rank and beat number only).
            store_limits: what the store this rank hosts takes at most
                (:class:`StoreLimits`; default ``StoreLimits()``).
            store: form through another store than the one rank 0 hosts (``host`` and
                ``port`` are then None): an etcd cluster, ``"etcd://HOST:PORT/PREFIX"``
                (``pip install 'ctrlcomm[etcd]'``; each process's keys are on a lease, gone
                10 s after it is), or a torch ``Store`` object (a ``TCPStore`` the job has
                up already). Needs ``auth_key``: whoever reaches such a store can read
                what formation keeps there.
            spin_us: with ``"shm"``, how long a wait for a same-host peer looks at the
                shared memory before it sleeps in the kernel, in microseconds (default 50,
                or ``CTRLCOMM_SPIN_US``; 0: never). It spins only where every rank of this
                host has a CPU, yields the CPU (and the GIL) between looks, and stops
                spinning for a peer that keeps coming later than that.

        Raises:
            InvalidArgumentError: bad rank, world size, name, timeout, codec or
                ``bind_host`` (one that does not resolve).
            StoreError: the store's port is in use (naming the address), it is
                unreachable, or ``host`` does not resolve; or it runs with an ``auth_key``
                (or encryption) where this rank has none, or none where this rank has one
                (said once a request has gone a second unanswered).
            FormationTimeoutError: not every rank joined within ``timeout``; names them.
                Host names are looked up within it too (the system's resolver has no
                deadline of its own): a lookup that takes longer raises it, naming the host.
            FormationError: another process already joined with this rank, or the ranks
                were created with different world sizes, codecs or transports (named).
        """
        rank, world_size = _validate_world(rank, world_size)
        host, port, host_store = _external_address(store, host, port, host_store)
        host = _check_host(host, "host")
        t, transport, port, key, encrypt = _formation_settings(name, timeout, transport, codec,
                                                               port, auth_key, encrypt,
                                                               store is not None)
        live = None if liveness_timeout is None else _seconds(liveness_timeout)
        if live is not None and not live > 0:
            raise InvalidArgumentError(f"liveness_timeout must be > 0 or None, got "
                                       f"{show(liveness_timeout)}")
        try:
            spin = spin_budget(spin_us)
        except ValueError as e:
            raise InvalidArgumentError(f"Group.create: {e}") from None
        beat = _seconds(heartbeat_interval)
        if not beat > 0:
            raise InvalidArgumentError(f"heartbeat_interval must be > 0, got "
                                       f"{show(heartbeat_interval)}")
        rank0_hosts = host_store is None  # (for the error where the store answers nothing)
        if host_store is None:
            host_store = rank == 0
        # (_deadline: formation's, where it began before, as from_env's under torchrun)
        deadline = time.monotonic() + t if _deadline is None else _deadline
        # names looked up within formation's deadline (the resolver has none of its own);
        # sockets are given the numbers
        late = f"group {name!r} not formed within the timeout on rank {rank}"
        try:
            store_address = _store_host(host, port, deadline - time.monotonic())
        except StoreTimeoutError as e:
            raise FormationStoreTimeoutError(f"{late}: {e}") from None
        if bind_host is not None:
            try:
                bind_host = _bind_address(bind_host, deadline - time.monotonic())
            except TimeoutError as e:
                raise FormationTimeoutError(f"{late}: bind_host: {e}") from None
        try:
            server = _acquire_server(store_address, port, key, encrypt, store_limits) \
                if host_store else None
        except StoreError as e:
            # the port taken: by the store of a group of this name formed without this
            # process, say (a second or restarted rank 0), which it is told, not "in use"
            _formed_elsewhere(host, store_address, port, key, encrypt, rank, name, deadline,
                              str(e))
            raise
        dropped = server.dropped if server is not None else 0
        external, store = store, None
        ep = hb = None
        try:
            store = _group_store(host, port, name, key, encrypt, t, external, store_address)
            # a store on every interface (host "0.0.0.0", as TRL's vLLM workers give it):
            # this rank is on the store's host (where a connection to 0.0.0.0 goes), and the
            # ranks elsewhere reach it by their own store address, which may be any interface
            # of this host: it binds every interface too, and publishes "*" for its address
            # (each peer reads the address it reaches the store by: _reachable)
            if bind_host is None:
                bind_host = store_address if _wildcard(store_address) \
                    else local_address_for(store_address, port)
            warn_if_unkeyed(f"group {name!r}", bind_host, key)
            setup = _Setup(host, store_address, port, bind_host, codec, transport, key, encrypt,
                           zmq_context, beat, live, spin, t, external)
            ep, hb = _new_parts(setup, rank)
            core = _form_core(_Joining(store, server, setup, ep, hb, rank, world_size, name,
                                       deadline, rank0_hosts, dropped, _late_check))
        except BaseException:
            if hb is not None:
                hb.close()
            if ep is not None:
                ep.close()
            if store is not None:
                store.close()
            if server is not None:
                _release_server(store_address, port)
            raise
        g = cls(core, store=store, server=server,
                server_key=(store_address, port) if server is not None else None)
        g._setup = setup
        return g

    @classmethod
    def from_torch(cls, process_group: Any = None, **kwargs: Any) -> Group:
        """A group with the same ranks as a torch process group (``None``: the default group),
        formed through that group once. Needs ``pip install 'ctrlcomm[torch]'``; see
        :func:`ctrlcomm.torch.group_from_torch` for the options."""
        from ._torchgroup import form

        return form(cls, process_group, **kwargs)

    @classmethod
    async def acreate(cls, host: str | None, port: int | None, rank: int, world_size: int,
                      **kwargs: Any) -> Group:
        """:meth:`create`, awaited: formation runs in a thread of the event loop's executor,
        so the loop goes on meanwhile (its waits release the GIL; its bursts of work, a few
        milliseconds, share it). Cancelled, the task ends at once; a group formed after
        that is closed (formation itself ends at its deadline at the latest)."""
        return await _in_thread(functools.partial(cls.create, host, port, rank, world_size,
                                                  **kwargs))

    @classmethod
    async def afrom_env(cls, **kwargs: Any) -> Group:
        """:meth:`from_env`, awaited (as :meth:`acreate`)."""
        return await _in_thread(functools.partial(cls.from_env, **kwargs))

    @classmethod
    def from_env(cls, **kwargs: Any) -> Group:
        """Form a group from ``CTRLCOMM_HOST``, ``CTRLCOMM_PORT``, ``CTRLCOMM_RANK``,
        ``CTRLCOMM_WORLD_SIZE`` (and optional ``CTRLCOMM_NAME``, ``CTRLCOMM_TIMEOUT``), each
        falling back to torchrun's ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``.

        Under torchrun (its agent's TCPStore listens on ``MASTER_PORT``,
        ``TORCHELASTIC_USE_AGENT_STORE=True``) and without ``CTRLCOMM_PORT``, rank 0 hosts
        ctrlcomm's store on a free port of the interface that reaches ``MASTER_ADDR`` and
        tells the others through the agent's store (this needs torch, which torchrun has).
        Elsewhere, note that torch.distributed's own store also listens on ``MASTER_PORT``
        when it is initialized from the same variables: set ``CTRLCOMM_PORT`` to another
        port then. Keyword arguments are passed on to :meth:`create`.
        """
        env = os.environ
        given = sorted({"host", "port", "rank", "world_size"} & kwargs.keys())
        if given:
            raise InvalidArgumentError(
                f"Group.from_env: {', '.join(given)} come from the environment (CTRLCOMM_* or "
                "torchrun's variables); to give them, call Group.create")

        def pick(mine: str, torchrun: str) -> str:
            v = env.get(mine) or env.get(torchrun)
            if not v:
                raise InvalidArgumentError(f"Group.from_env: set {mine} (or {torchrun})")
            return v

        vals = {}
        for mine, theirs in (("CTRLCOMM_PORT", "MASTER_PORT"), ("CTRLCOMM_RANK", "RANK"),
                             ("CTRLCOMM_WORLD_SIZE", "WORLD_SIZE")):
            raw = pick(mine, theirs)
            try:
                vals[mine] = int(raw)
            except ValueError:
                raise InvalidArgumentError(f"Group.from_env: {mine}/{theirs} must be an int, "
                                           f"got {show(raw)}") from None
        host = pick("CTRLCOMM_HOST", "MASTER_ADDR")
        if "CTRLCOMM_NAME" in env:
            kwargs.setdefault("name", env["CTRLCOMM_NAME"])
        if "CTRLCOMM_TIMEOUT" in env and "timeout" not in kwargs:
            raw = env["CTRLCOMM_TIMEOUT"]
            secs = _env_seconds(raw)
            if not secs > 0:
                raise InvalidArgumentError(f"Group.from_env: CTRLCOMM_TIMEOUT must be a number "
                                           f"of seconds > 0, got {show(raw)}")
            kwargs["timeout"] = secs
        if not env.get("CTRLCOMM_PORT") and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return _through_agent_store(cls, host, vals["CTRLCOMM_PORT"], vals["CTRLCOMM_RANK"],
                                        vals["CTRLCOMM_WORLD_SIZE"], kwargs)
        return cls.create(host, vals["CTRLCOMM_PORT"], vals["CTRLCOMM_RANK"],
                          vals["CTRLCOMM_WORLD_SIZE"], **kwargs)

    # -------------------------------------------------------------------- properties

    @property
    def aio(self) -> AioGroup:
        """The asyncio view: the same calls, awaited. It keeps the group (code may keep the
        view only); the group keeps it by a weak reference (no cycle: a group dropped
        without close() goes with its last reference, its view's included)."""
        view = self._aio() if self._aio is not None else None
        if view is None:
            view = AioGroup(self)
            self._aio = weakref.ref(view)
        return view

    @property
    def rank(self) -> int:
        return self._core.rank

    @property
    def world_size(self) -> int:
        return self._core.size

    size = world_size

    @property
    def name(self) -> str:
        return self._core.name

    @property
    def timeout(self) -> float:
        return self._core.timeout

    @property
    def closed(self) -> bool:
        """Whether the group was closed (``close()``, or leaving its ``with`` block)."""
        return self._core.state == CLOSED

    @property
    def broken(self) -> bool:
        """Whether the group broke (a failure, or ``abort()``: see the README's table): it
        stays so once closed (``closed`` is then true too)."""
        return self._core.cause is not None

    def stats(self) -> dict[str, Any]:
        """Counters: messages sent and received, and frames dropped by reason."""
        c = self._core
        dropped = dict(c.dropped)
        for part in (c.ep, c.hb):  # (the transport's and the heartbeats' drops)
            for k, v in list(getattr(part, "dropped", {}).items()):  # (one step: see Heartbeat)
                dropped[k] = dropped.get(k, 0) + v
        return {"sent": c.sent, "received": c.received, "dropped": dropped,
                "seq": c.seq, "state": c.state, "transport": c.ep.kind}

    def flight_record(self) -> list[dict[str, Any]]:
        """This rank's last calls on the group (a flight recorder, as torch's for NCCL):
        oldest first, then those in progress. Each is a dict: ``op`` (``"all_reduce"``,
        ``"send"``, ``"recv"``...), ``seq`` (a collective's number; None for point to point),
        ``root``, ``peer`` and ``tag`` (point to point), ``state`` (``"done"``,
        ``"failed"``, ``"running"``), ``error`` (how it failed), ``started`` (``time.time()``
        seconds), ``duration_s`` (so far, where running), ``messages_sent``,
        ``messages_received``, ``bytes_sent`` and ``bytes_received`` (the encoded size
        of what this rank sent, each object once however many ranks it went to, and of
        what it received; None where not known yet), and ``waited_for``: the ranks it
        waited for last (a call that completed: the last to come; one in progress: those
        it waits for). A point-to-point call of a drop-in shows under the drop-in's name
        (``send_obj``), with the drop-in's tag.

        It keeps 64 calls, or ``CTRLCOMM_FLIGHT_RECORD`` (0: none). The error that ends a
        call carries it (its ``flight_record``); :func:`ctrlcomm.dump_flight_records`
        writes every group's, on a signal where asked."""
        return self._core.flight_record()

    def __repr__(self) -> str:
        c = self._core
        return f"<ctrlcomm.Group {c.name!r} rank {c.rank}/{c.size} {c.state} at {c.ep.address}>"

    # ------------------------------------------------------------------- collectives

    def barrier(self, *, timeout: float | None = None) -> None:
        """Return once every rank has entered the barrier."""
        _run_sync(self._core, _barrier_call(self._core.size), timeout)

    def broadcast(self, obj: Any, src: int = 0, *, timeout: float | None = None) -> Any:
        """``src``'s ``obj`` on every rank (``obj`` is ignored elsewhere)."""
        return _run_sync(self._core, _spec_broadcast(self._core, obj, src), timeout)

    def gather(self, obj: Any, dst: int = 0, *, timeout: float | None = None) -> list[Any] | None:
        """The list of every rank's ``obj`` (in rank order) on ``dst``; ``None`` elsewhere."""
        return _run_sync(self._core, _spec_gather(self._core, obj, dst), timeout)  # type: ignore[no-any-return]

    def all_gather(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        """The list of every rank's ``obj``, in rank order, on every rank."""
        return _run_sync(self._core, _spec_all_gather(self._core, obj), timeout)  # type: ignore[no-any-return]

    def scatter(self, objs: Sequence[Any] | None, src: int = 0, *,
                timeout: float | None = None) -> Any:
        """Rank ``i`` gets ``objs[i]`` from ``src``; ``objs`` matters only on ``src``: a
        sequence of one object per rank, or any sized iterable of them (a numpy array: its
        rows), not text, bytes, a mapping or a set."""
        return _run_sync(self._core, _spec_scatter(self._core, objs, src), timeout)

    def reduce(self, obj: Any, op: _ops.Op = "sum", dst: int = 0, *,
               timeout: float | None = None) -> Any:
        """Every rank's ``obj`` combined by ``op`` on ``dst``; ``None`` elsewhere."""
        return _run_sync(self._core, _spec_reduce(self._core, obj, op, dst), timeout)

    def all_reduce(self, obj: Any, op: _ops.Op = "sum", *, timeout: float | None = None) -> Any:
        """Every rank's ``obj`` combined by ``op`` (element-wise for tuples/lists), everywhere.

        ``op`` is one of ``"sum" "prod" "max" "min" "band" "bor" "land" "lor"`` or a callable
        ``f(a, b)`` that is associative and commutative. Every rank gets the same result
        (ranks combine in the same order).
        """
        return _run_sync(self._core, _spec_all_reduce(self._core, obj, op), timeout)

    def all_to_all(self, objs: Sequence[Any], *, timeout: float | None = None) -> list[Any]:
        """Rank ``i`` sends ``objs[j]`` to rank ``j``; returns what each rank sent to this one."""
        return _run_sync(self._core, _spec_all_to_all(self._core, objs), timeout)  # type: ignore[no-any-return]

    # ---------------------------------------------------------------- point to point

    def send(self, obj: Any, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Queue ``obj`` for ``dst`` and return (messages per (src, tag) stay in order).

        Returns at once unless more than 4 MiB are already queued for ``dst`` (a receiver
        that does not keep up): then it waits, up to ``timeout``, for the queue to drain.
        """
        c = self._core
        dst, tag, t = _p2p_args(c, dst, "dst", tag, timeout, "send")
        if dst == c.rank:  # (as MPI: for its own recv)
            return c.send_self(obj, tag, f"send(dst={dst}, tag={tag})")
        run_sync(c, c.send(obj, dst, tag, t))

    def recv(self, src: int, tag: int = 0, *, timeout: float | None = None) -> Any:
        """The next object ``src`` sent to this rank with ``tag``."""
        c = self._core
        src, tag, t = _p2p_args(c, src, "src", tag, timeout, "recv")
        if src == c.rank:  # (what it sent itself; none: an error, not a wait for ever)
            return c.recv_self(tag, f"recv(src={src}, tag={tag})")
        return run_sync(c, c.recv(src, tag, t))

    # ---------------------------------------------------------- groups from this group

    def split(self, color: int | None, key: int = 0, *, name: str | None = None,
              timeout: float | None = None) -> Group | None:
        """New groups of this group's ranks, as ``MPI_Comm_split``: collective (every rank
        calls it); the ranks that give one ``color`` form a group, ranked by ``key``, then by
        rank here; a rank whose color is ``None`` gets ``None``. No store: the ranks swap
        their new addresses in one all_gather here. ``name``: the new group's (default:
        this one's, a dot and the color); ``timeout``: as a collective's."""
        sp = split_begin(self._core, self._setup, color, key, name)
        return self._split_end(sp, self._gathered(sp, timeout), "split")

    def new_group(self, ranks: Sequence[int], *, name: str | None = None,
                  timeout: float | None = None) -> Group | None:
        """A group of ``ranks`` of this group, as ``torch.distributed.new_group``: collective
        (every rank calls it, with the same ranks); ranked in the order of their ranks here;
        a rank not in ``ranks`` gets ``None``."""
        sp = split_begin(self._core, self._setup, None, 0, name, ranks)
        return self._split_end(sp, self._gathered(sp, timeout), "new_group")

    def _gathered(self, sp: Any, timeout: float | None) -> list[Any]:
        try:
            return self.all_gather(sp.item, timeout=timeout)
        except BaseException:
            sp.close()  # (its new endpoint and heartbeat)
            raise

    def _split_end(self, sp: Any, got: list[Any], what: str) -> Group | None:
        try:
            made = split_end(sp, self._core, self._setup, got, what)
        except BaseException:
            sp.close()
            raise
        return None if made is None else self._child(made)

    def shrink(self, timeout: float | None = None) -> Group:
        """The group of the ranks of this one still alive, renumbered in their order here
        (``parent_ranks`` keeps the old numbers): called by every survivor, after a
        :class:`PeerLostError` or on a working group. Needs no store: the survivors agree
        over their connections here, so it works when rank 0 (the store's host) is the one
        lost, and every survivor gets the same group even where more ranks fail during it.
        A rank taken for lost by the others (hung past ``liveness_timeout``) gets
        :class:`GroupBrokenError`. This group stays as it is: close it."""
        parts, attempt = self._shrink_begin(timeout)
        try:
            made = run_sync(self._core, shrink_plan(self._core, self._setup, parts, attempt,
                                                    _timeout_arg(timeout, "shrink")))
        except BaseException:
            parts.close()
            raise
        return self._child(made)

    def _shrink_begin(self, timeout: Any) -> tuple[Parts, int]:
        _timeout_arg(timeout, "shrink")
        if self._core.state == CLOSED:
            self._core.check_open()  # (raises: a broken group may shrink, a closed one not)
        parts = Parts(self._setup, self._core.size)
        self._shrinks += 1
        return parts, self._shrinks

    def grow(self, world_size: int, *, timeout: float | None = None) -> Group:
        """This group's ranks and new processes, in a new group of ``world_size`` ranks:
        collective here; the new processes call :meth:`join` (with this group's store
        address and name). This group's ranks keep their numbers, the new ones come after
        (``parent_ranks``: None for them). The store the new processes reach is this
        group's, at the address it was created with: served by this group's rank 0 (it
        takes the store's role where the rank that hosted it is gone, as after a
        :meth:`shrink` that left out rank 0; it must be on the store's host then)."""
        c, s = self._core, self._setup
        size = _validate_world(0, world_size)[1]
        t = _timeout_arg(timeout, "grow", c.rank) or c.timeout
        deadline = time.monotonic() + t
        if size <= c.size:
            raise InvalidArgumentError(f"grow on rank {c.rank}: world_size must be above the "
                                       f"group's {c.size}, got {size}")
        served, why = None, ""
        if c.rank == 0 and s.external is None:  # (the store this process serves, or a new
            # one where it serves none)
            try:
                served = _acquire_server(s.store_address, s.port, s.key, s.encrypt)
            except (StoreError, OSError) as e:
                if not _answers(s):  # (else another process serves it: a parent's rank 0)
                    why = (f"rank 0 cannot serve the group's store at {s.store_address}:"
                           f"{s.port} ({e}), and no store answers there: the rank that "
                           "served it is gone, and this one runs on another host (use an "
                           "external store: `ctrlcomm store`)")
        try:
            said = self.all_gather([size, why], timeout=t)
            sizes = sorted({int(x[0]) for x in said})
            if len(sizes) > 1:
                raise InvalidArgumentError(f"grow on group {c.name!r}: the ranks asked for "
                                           f"different world sizes: {sizes}")
            if said[0][1]:
                raise StoreError(f"grow on group {c.name!r}: {said[0][1]}")
            g = _grow(self, size, deadline)
        except BaseException:
            if served is not None:
                _release_server(s.store_address, s.port)
            raise
        if served is not None:
            g._server = served
            g._keep_server((s.store_address, s.port))
        g.parent_ranks = [*range(c.size), *[None] * (size - c.size)]
        return g

    @classmethod
    def join(cls, host: str | None, port: int | None, name: str = "default", *, timeout: float = 300.0,
             **kwargs: Any) -> Group:
        """Join group ``name``, formed through the store at ``(host, port)``, as a new
        rank, once its ranks call :meth:`grow`: waits for that, up to ``timeout``. The new
        ranks are numbered in the order they join, after the group's. Keyword arguments are
        :meth:`create`'s (they must match the group's: codec, transport, auth_key...)."""
        if "rank" in kwargs or "world_size" in kwargs or "host_store" in kwargs:
            raise InvalidArgumentError("Group.join: the rank and world size come from the "
                                       "group that grows, and its rank 0 hosts the store")
        t = _timeout_arg(timeout, "Group.join")
        if t is None:
            raise InvalidArgumentError("Group.join: timeout must be > 0 seconds, got None")
        deadline = time.monotonic() + t
        key = auth_key_or_env(kwargs.get("auth_key"))
        external = kwargs.get("store")
        if external is not None:
            _external_address(external, host, port, None)
        elif host is None or port is None:
            raise InvalidArgumentError("Group.join: give the group's store host and port "
                                       "(or its store=)")
        with _group_store(host, port, name, key, bool(kwargs.get("encrypt", False)), t,
                          external) as store:
            try:
                token, old, new = store.get(GROW, timeout=t).decode().split(" ")
                ticket = store.add(f"{GROW}/{token}", 1, timeout=max(
                    deadline - time.monotonic(), 0.001))
            except StoreTimeoutError as e:
                where = f"the store at {store.host}:{store.port}"
                raise FormationTimeoutError(
                    f"Group.join: group {name!r} did not grow within the timeout (its ranks "
                    "call grow; " + (f"{where} answered)" if e.answered else
                                     f"{where} answered nothing: is it running?)")) from None
        rank = int(old) + ticket - 1
        if rank >= int(new):
            raise FormationError(f"Group.join: group {name!r} grows to {new} ranks, and "
                                 f"{ticket} processes joined (this one is too many)")
        g = cls.create(host, port, rank, int(new), name=name, timeout=t, host_store=False,
                       _deadline=deadline, _late_check=False, **kwargs)
        g.parent_ranks = [*range(int(old)), *[None] * (int(new) - int(old))]
        return g

    def _child(self, made: Made) -> Group:
        g = type(self)(made.core, store=None, server=None, server_key=None)
        g._setup = self._setup
        g.parent_ranks = list(made.parent_ranks)
        return g

    # -------------------------------------------------------------------- lifecycle

    def abort(self, reason: str = "aborted") -> None:
        """Break the group here and tell the peers, whose pending calls fail naming this rank."""
        self._core.abort(str(reason))

    def close(self) -> None:
        """Close the group (idempotent; never blocks). Peers waiting on this rank fail fast.
        (A group dropped without it is closed once the garbage collector takes it.)"""
        if self._finalizer is not None:
            self._finalizer.detach()
        key, self._server_key = self._server_key, None
        _close_parts(self._core, self.store, key)

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_parts(core: Core, store: StoreClient | None,
                 server_key: tuple[str, int] | None) -> None:
    """What Group.close does, for a group collected without it."""
    core.close()
    if store is not None:
        if core.rank == 0 and not getattr(store, "leased", False):
            # its table goes, so that a new group of this name may form (etcd's goes with
            # the lease as the client closes); an external store's in a thread: a torch
            # store's calls have no deadline of their own, and close() waits for nothing
            if isinstance(store, StoreClient):
                _forget_table(store, core.group_id, core.name)
            else:
                threading.Thread(target=_forget_table, args=(store, core.group_id, core.name),
                                 daemon=True, name="ctrlcomm-close").start()
                store = None  # (the thread closes it)
        if store is not None:
            store.close()
    if server_key is not None:
        _release_server(*server_key)


def _forget_table(store: Any, group_id: int, name: str) -> None:
    """Delete the group's table (FORMED) from the store: only its own (a group grown from it,
    of the same name, may have put its own there since). Best effort. An external store's
    client is closed here (this runs in a thread of its own then)."""
    try:
        held = store.get(FORMED, wait=False, timeout=CLOSE_ASK_S).decode(errors="replace")
        if _group_id(name, held.split("\n", 1)[0]) == group_id:
            store.delete(FORMED, timeout=CLOSE_ASK_S)
    except (StoreError, OSError, KeyError):
        pass  # (the store may be gone, or the table)
    if not isinstance(store, StoreClient):
        store.close()


# Objects collected unclosed: their finalizers queue what closes them (SimpleQueue.put is
# safe in a finalizer, which runs wherever the collector does: under any lock, in any
# thread), and one thread of the process does it.
_dropped: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...], int]] = \
    queue.SimpleQueue()
_closer: threading.Thread | None = None
_closer_lock = threading.Lock()


_all_groups: weakref.WeakSet[Group] = weakref.WeakSet()  # (for dump_flight_records)


def dump_flight_records(file: Any = None) -> None:
    """Write the flight record (:meth:`Group.flight_record`) of every group of this process
    that is not closed, one JSON line per group, to ``file`` (a text file; default
    ``sys.stderr``). (On a signal: :func:`dump_flight_records_on`.)"""
    out = sys.stderr if file is None else file
    for g in list(_all_groups):
        c = g._core
        if c.state == CLOSED:
            continue
        out.write(json.dumps({"group": c.name, "rank": c.rank, "world_size": c.size,
                              "pid": os.getpid(), "state": c.state,
                              "cause": None if c.cause is None else str(c.cause),
                              "calls": g.flight_record()}, default=repr) + "\n")
    out.flush()


def dump_flight_records_on(signum: int = signal.SIGUSR1, file: Any = None) -> None:
    """Dump every group's flight record (:func:`dump_flight_records`) when this process
    gets ``signum`` (``kill -USR1 PID``), as torch's NCCL flight recorder does; the signal's
    earlier handler is replaced. Call it from the main thread (Python runs signal handlers
    there, between bytecodes, even while a call waits in the kernel)."""
    if threading.current_thread() is not threading.main_thread():
        raise InvalidArgumentError("dump_flight_records_on: call it from the main thread "
                                   "(Python installs signal handlers there only)")
    try:
        signal.signal(signum, lambda _s, _f: _dump_quietly(file))
    except (ValueError, OSError) as e:
        raise InvalidArgumentError(f"dump_flight_records_on: signal {signum!r}: {e}") from None


def _dump_quietly(file: Any) -> None:
    """:func:`dump_flight_records` from a signal handler: it runs inside whatever the main
    thread was doing, a collective maybe, which an error raised here would end (and break
    the group on every rank). A dump that fails (a closed file, a broken pipe, a write
    into a write in progress) is given up, saying so where it can."""
    try:
        dump_flight_records(file)
    except Exception as e:
        try:
            os.write(2, f"ctrlcomm: flight record dump failed: {type(e).__name__}: {e}\n"
                     .encode(errors="replace"))
        except OSError:
            pass


def close_when_dropped(obj: object, fn: Callable[..., None], *args: Any
                       ) -> weakref.finalize[Any, Any]:
    """Call ``fn(*args)`` (in the closer thread) once ``obj`` is collected, unless the
    returned finalizer is detached first. Not at exit: what was sent last still goes out
    then as for a group left open (the transport's linger)."""
    global _closer
    with _closer_lock:
        if _closer is None or not _closer.is_alive():  # (also in a forked child)
            _closer = threading.Thread(target=_close_dropped, name="ctrlcomm-closer",
                                       daemon=True)
            _closer.start()
    f = weakref.finalize(obj, _dropped.put, (fn, args, os.getpid()))
    f.atexit = False
    return f


_closing = [False]  # whether the closer thread is closing one now


def _close_dropped() -> None:
    while True:
        fn, args, pid = _dropped.get()
        _closing[0] = True
        try:
            if pid == os.getpid():  # (in a forked child the sockets are the parent's)
                fn(*args)
        except Exception as e:  # (nobody to raise it to)
            log.debug("closing a dropped group failed: %s: %s", type(e).__name__, e)
        finally:
            _closing[0] = False
        del fn, args, pid


def _await_closer(timeout: float) -> None:
    """At exit: wait (at most ``timeout`` s) for the groups collected so far to be closed,
    so that what they queued goes out with the rest (the closer is a daemon thread, which
    the exit does not wait for: a group collected as its process returned lost what it
    still had queued). Looked at twice, 5 ms apart: the closer takes an item, then says it
    is closing."""
    end = time.monotonic() + timeout
    quiet = 0
    while quiet < 2 and time.monotonic() < end:
        if _dropped.empty() and not _closing[0]:
            quiet += 1
        else:
            quiet = 0
        time.sleep(0.005)


BEFORE_EXIT_FLUSH.append(_await_closer)


class AioGroup:
    """The asyncio view of a :class:`Group` (``group.aio``): the same calls, awaited.

    Waiting goes through the running event loop (a reader on the socket's descriptor): other
    coroutines keep running while a call waits. Cancelling an awaited collective breaks the
    group (peers may have taken part of it); cancelling ``recv`` leaves it working. Awaited
    collectives of one event loop take turns, first come first; one cancelled while still
    queued behind another is not made here, though the other ranks may make it: the group
    breaks once the call before it has ended.
    """

    def __init__(self, group: Group) -> None:
        self._group = group  # (kept alive by its view: see Group.aio)
        self._core = group._core

    @property
    def rank(self) -> int:
        return self._core.rank

    @property
    def world_size(self) -> int:
        return self._core.size

    @_coroutine_function
    def barrier(self, *, timeout: float | None = None) -> Coroutine[Any, Any, None]:
        return _Awaited(self._core, "barrier", lambda: _run_async(
            self._core, _barrier_call(self._core.size), timeout))

    @_coroutine_function
    def broadcast(self, obj: Any, src: int = 0, *, timeout: float | None = None
                  ) -> Coroutine[Any, Any, Any]:
        return _Awaited(self._core, "broadcast", lambda: _run_async(
            self._core, _spec_broadcast(self._core, obj, src), timeout))

    @_coroutine_function
    def gather(self, obj: Any, dst: int = 0, *,
               timeout: float | None = None) -> Coroutine[Any, Any, list[Any] | None]:
        return _Awaited(self._core, "gather", lambda: _run_async(
            self._core, _spec_gather(self._core, obj, dst), timeout))

    @_coroutine_function
    def all_gather(self, obj: Any, *, timeout: float | None = None
                   ) -> Coroutine[Any, Any, list[Any]]:
        return _Awaited(self._core, "all_gather", lambda: _run_async(
            self._core, _spec_all_gather(self._core, obj), timeout))

    @_coroutine_function
    def scatter(self, objs: Sequence[Any] | None, src: int = 0, *,
                timeout: float | None = None) -> Coroutine[Any, Any, Any]:
        return _Awaited(self._core, "scatter", lambda: _run_async(
            self._core, _spec_scatter(self._core, objs, src), timeout))

    @_coroutine_function
    def reduce(self, obj: Any, op: _ops.Op = "sum", dst: int = 0, *,
               timeout: float | None = None) -> Coroutine[Any, Any, Any]:
        return _Awaited(self._core, "reduce", lambda: _run_async(
            self._core, _spec_reduce(self._core, obj, op, dst), timeout))

    @_coroutine_function
    def all_reduce(self, obj: Any, op: _ops.Op = "sum", *,
                   timeout: float | None = None) -> Coroutine[Any, Any, Any]:
        return _Awaited(self._core, "all_reduce", lambda: _run_async(
            self._core, _spec_all_reduce(self._core, obj, op), timeout))

    @_coroutine_function
    def all_to_all(self, objs: Sequence[Any], *,
                   timeout: float | None = None) -> Coroutine[Any, Any, list[Any]]:
        return _Awaited(self._core, "all_to_all", lambda: _run_async(
            self._core, _spec_all_to_all(self._core, objs), timeout))

    async def split(self, color: int | None, key: int = 0, *, name: str | None = None,
                    timeout: float | None = None) -> Group | None:
        """:meth:`Group.split`, awaited."""
        g = self._group
        sp = split_begin(self._core, g._setup, color, key, name)
        return g._split_end(sp, await self._gathered(sp, timeout), "split")

    async def new_group(self, ranks: Sequence[int], *, name: str | None = None,
                        timeout: float | None = None) -> Group | None:
        """:meth:`Group.new_group`, awaited."""
        g = self._group
        sp = split_begin(self._core, g._setup, None, 0, name, ranks)
        return g._split_end(sp, await self._gathered(sp, timeout), "new_group")

    async def _gathered(self, sp: Any, timeout: float | None) -> list[Any]:
        try:
            return await self.all_gather(sp.item, timeout=timeout)
        except BaseException:
            sp.close()
            raise

    async def shrink(self, timeout: float | None = None) -> Group:
        """:meth:`Group.shrink`, awaited."""
        g = self._group
        parts, attempt = g._shrink_begin(timeout)
        try:
            made = await run_async(self._core, shrink_plan(
                self._core, g._setup, parts, attempt, _timeout_arg(timeout, "shrink")))
        except BaseException:
            parts.close()
            raise
        return g._child(made)

    async def send(self, obj: Any, dst: int, tag: int = 0, *,
                   timeout: float | None = None) -> None:
        c = self._core
        dst, tag, t = _p2p_args(c, dst, "dst", tag, timeout, "send")
        if dst == c.rank:
            return c.send_self(obj, tag, f"send(dst={dst}, tag={tag})")
        await run_async(c, c.send(obj, dst, tag, t))

    async def recv(self, src: int, tag: int = 0, *, timeout: float | None = None) -> Any:
        c = self._core
        src, tag, t = _p2p_args(c, src, "src", tag, timeout, "recv")
        if src == c.rank:
            return c.recv_self(tag, f"recv(src={src}, tag={tag})")
        return await run_async(c, c.recv(src, tag, t))


__all__ = ["Group", "AioGroup", "StoreError"]
