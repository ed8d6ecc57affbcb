"""Groups: formation through the store, and the blocking and asyncio views.

Every call is described once by a ``_spec_*`` function (validation, plan, op code, result
post-processing); :class:`Group` runs it with the blocking driver and :class:`AioGroup` with the
asyncio driver. Both views share one :class:`ctrlcomm._core.Core`, hence one sequence counter.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import ipaddress
import logging
import operator
import os
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Coroutine, Generator, Iterable, Mapping, Sequence, Sized
from collections.abc import Set as AbstractSet
from typing import Any, TypeVar

from . import _ops, _plans, _transport
from . import _wire as w
from ._algo import choose
from ._core import Call, Core, cancelled_before_it_began, run_async, run_sync
from ._errors import (
    CodecError,
    CtrlcommError,
    FormationError,
    FormationStoreTimeoutError,
    FormationTimeoutError,
    InvalidArgumentError,
    OperandError,
    ReductionError,
    StoreError,
    StoreTimeoutError,
    show,
)
from ._store import StoreClient, StoreLimits, _check_host, _secs, _store_host, port_arg
from ._transport import (
    Heartbeat,
    StoreServer,
    TcpEndpoint,
    _parse_tcp,
    _tcp,
    _wildcard,
    auth_key_or_env,
    curve_available,
    local_address_for,
    make_endpoint,
    proc_address,
    resolve,
    same_host_procs,
    warn_if_unkeyed,
)

CODECS = {"pickle": w.PICKLE, "msgpack": w.MSGPACK}
log = logging.getLogger("ctrlcomm")


# ------------------------------------------------------------------------- call specs


def _rank_arg(core: Core, value: Any, what: str, op: str) -> int:
    try:
        r = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(
            f"{op} on rank {core.rank}: {what} must be an int, got {show(value)}") from None
    if not 0 <= r < core.size or isinstance(value, bool):
        raise InvalidArgumentError(
            f"{op} on rank {core.rank}: {what}={show(value)} is not a rank of group {core.name!r} "
            f"(world size {core.size})")
    return r


def _p2p_args(core: Core, peer: Any, what: str, tag: Any, timeout: Any, op: str
              ) -> tuple[int, int, float | None]:
    """A point-to-point call's peer (``what``: "dst" or "src"; this rank itself too), tag and
    timeout, checked."""
    return (_rank_arg(core, peer, what, op), _tag_arg(core, tag, op),
            _timeout_arg(timeout, op, core.rank))


def _seconds(value: Any) -> float:
    """``value`` in seconds, as the store's methods take it (a number, or a timedelta, as
    torch.distributed's timeouts are); NaN where it is none (NaN fails every ``> 0`` check)."""
    try:
        return _secs(value)
    except InvalidArgumentError:
        return float("nan")


def _env_seconds(raw: str) -> float:
    """An environment variable's seconds (a number); NaN where it is none."""
    try:
        return float(raw)
    except ValueError:
        return float("nan")


def _env_liveness(raw: str | None) -> float | None:
    """The default ``liveness_timeout``: 5 s, or ``CTRLCOMM_LIVENESS_TIMEOUT``."""
    if raw is None:
        return 5.0
    if raw.strip().lower() in ("none", "off"):
        return None
    v = _env_seconds(raw)
    if not v > 0:
        log.warning("CTRLCOMM_LIVENESS_TIMEOUT=%r is not a number of seconds > 0 or 'none': "
                    "the default of 5 s applies", raw)
        return 5.0
    return v


LIVENESS_TIMEOUT_S = _env_liveness(os.environ.get("CTRLCOMM_LIVENESS_TIMEOUT"))


def _timeout_arg(timeout: Any, op: str, rank: int | None = None) -> float | None:
    if timeout is None:
        return None
    t = _seconds(timeout)
    if not t > 0:
        where = op if rank is None else f"{op} on rank {rank}"
        raise InvalidArgumentError(f"{where}: timeout must be > 0 seconds, got {show(timeout)}")
    return t


def _tag_arg(core: Core, tag: Any, op: str) -> int:
    if type(tag) is int and -(1 << 63) <= tag < (1 << 63):  # the usual
        return tag
    try:
        t = operator.index(tag)
    except TypeError:
        raise InvalidArgumentError(f"{op} on rank {core.rank}: tag must be an int, "
                                   f"got {show(tag)}") from None
    if not -(1 << 63) <= t < (1 << 63):
        raise InvalidArgumentError(f"{op} on rank {core.rank}: tag {t} out of range (int64)")
    return t


def _per_rank(core: Core, objs: Any, op: str) -> list[Any]:
    """``objs``, one object per rank, as a list: from a sequence, or any sized iterable in
    order (a numpy array or a tensor: its rows, or elements, as mpi4py takes them); not
    from text, bytes, a mapping or a set (which would scatter characters, bytes, keys or
    members in no order)."""
    if (type(objs) is list or type(objs) is tuple) and len(objs) == core.size:  # the usual
        return list(objs)
    n: int | None = None
    if not isinstance(objs, (str, bytes, bytearray, memoryview, Mapping, AbstractSet)) \
            and isinstance(objs, Iterable) and isinstance(objs, Sized):
        try:
            n = len(objs)
        except TypeError:  # (a 0-d array: sized in type only)
            pass
    if n is None:
        raise InvalidArgumentError(
            f"{op} on rank {core.rank}: objs must be a sequence of {core.size} objects (one "
            f"per rank), got {type(objs).__name__}")
    if n != core.size:
        raise InvalidArgumentError(
            f"{op} on rank {core.rank}: objs has {n} objects, group {core.name!r} has "
            f"{core.size} ranks (one object per rank)")
    try:
        out = list(objs)
        m = _ops._array_module(objs)
        if m is not None and m.__name__ == "torch" and hasattr(objs, "clone"):
            # a tensor's rows are views of its storage, and a view pickles with all of it:
            # each rank would get the whole tensor (and keep it)
            out = [x.detach().clone() for x in out]
    except Exception as e:
        raise InvalidArgumentError(f"{op} on rank {core.rank}: iterating over objs failed: "
                                   f"{type(e).__name__}: {e}") from e
    if len(out) != n:  # (an iterable that yields other than it says)
        raise InvalidArgumentError(
            f"{op} on rank {core.rank}: objs gave {len(out)} objects where its len() is {n}")
    return out


def _encodable(core: Core, objs: Sequence[Any], op: str) -> None:
    """With the data-only codec, reject what it cannot encode before anything is sent."""
    if core.codec == w.MSGPACK:
        for obj in objs:
            try:
                w.dumps(obj, w.MSGPACK)
            except CodecError as e:
                raise CodecError(f"{op} on rank {core.rank}: {e}") from None


def _sendable(core: Core, obj: Any, op: str) -> Any:
    """``obj``, or where the data-only codec cannot encode it, the failure to send in the
    call in its place (this rank alone can tell: raising here alone would leave the others
    waiting for its part, or pairing it with this rank's next call)."""
    try:
        _encodable(core, [obj], op)
    except CodecError as e:
        return _ops.Failed(str(e), "codec")
    return obj


def _sendable_each(core: Core, objs: list[Any], op: str) -> list[Any]:
    """As :func:`_sendable`, for one object per rank: where one fails, every rank gets the
    failure."""
    try:
        _encodable(core, objs, op)
    except CodecError as e:
        return [_ops.Failed(str(e), "codec")] * core.size
    return objs


_NO_ARGS: tuple[Any, ...] = ()
# the calls made most often build their Call with tuple.__new__: a named tuple's own __new__
# is a Python function, one more frame per call (all six fields are given)
_new_call = tuple.__new__
_BROADCAST, _ALL_GATHER = w.OP_CODE["broadcast"], w.OP_CODE["all_gather"]


@functools.lru_cache(maxsize=64)
def _barrier_call(size: int) -> Call:
    """The Call of every barrier of a world size (called from the methods: a cache hit runs
    no Python)."""
    return Call("barrier", choose("barrier", size), _NO_ARGS, w.OP_CODE["barrier"])


# A call may carry a rank's failure to encode its object in place of the object (a data-only
# group's, found before the call: _sendable; any group's, found sending: Core._unsendable):
# each call's result is checked (Call.reduces) and the failure raised everywhere.


def _spec_broadcast(core: Core, obj: Any, src: int) -> Call:
    root = _rank_arg(core, src, "src", "broadcast")
    checked = core.codec == w.MSGPACK
    if checked and core.rank == root:
        obj = _sendable(core, obj, "broadcast")
    # only the root knows the payload; every rank must pick the same plan, so the size
    # test cannot depend on it: the small-world variant is flat whatever the size
    return _new_call(Call, ("broadcast", choose("broadcast", core.size), (obj, root),
                            _BROADCAST, root, True))


def _spec_gather(core: Core, obj: Any, dst: int) -> Call:
    root = _rank_arg(core, dst, "dst", "gather")
    checked = core.codec == w.MSGPACK
    if checked:
        obj = _sendable(core, obj, "gather")
    return Call("gather", choose("gather", core.size), (obj, root), w.OP_CODE["gather"], root,
                True)


def _spec_all_gather(core: Core, obj: Any) -> Call:
    checked = core.codec == w.MSGPACK
    if checked:
        obj = _sendable(core, obj, "all_gather")
    return _new_call(Call, ("all_gather", choose("all_gather", core.size), (obj,),
                            _ALL_GATHER, w.NO_ROOT, True))


def _per_rank_or_failed(core: Core, objs: Any, op: str) -> list[Any]:
    """:func:`_per_rank`, or where ``objs`` is wrong, the failure for every rank: only this
    rank can tell (a scatter's root), so it still takes part, and every rank raises it
    (raising here alone would leave the others waiting for its part, or pairing it with this
    rank's next call)."""
    try:
        return _per_rank(core, objs, op)
    except InvalidArgumentError as e:
        return [_ops.Failed(str(e), "argument")] * core.size


def _spec_scatter(core: Core, objs: Any, src: int) -> Call:
    root = _rank_arg(core, src, "src", "scatter")
    mine = _per_rank_or_failed(core, objs, "scatter") if core.rank == root else None
    checked = core.codec == w.MSGPACK
    if checked and mine is not None:
        mine = _sendable_each(core, mine, "scatter")
    return Call("scatter", choose("scatter", core.size), (mine, root), w.OP_CODE["scatter"],
                root, True)


# (call name, named op) -> combine function, opcode, the number types the op takes unchecked
_NAMED_REDUCTIONS: dict[tuple[str, str],
                        tuple[Callable[[Any, Any], Any], int, frozenset[type]]] = {}


def _reduction(core: Core, name: str, obj: Any, op: Any
               ) -> tuple[Callable[[Any, Any], Any], int, Any]:
    """The combine function, the opcode and the operand to send: the operand itself, or,
    where the op cannot reduce it, a failure every rank of the call will raise (only this
    rank can tell: failing here alone would leave the others waiting for its part, or
    pairing it with this rank's next call)."""
    named = _NAMED_REDUCTIONS.get((name, op)) if type(op) is str else None
    if named is None:
        combine = _ops.combiner(op, name, core.rank)  # (an unknown op raises here)
        red = len(_ops.NAMED_OPS) + 1 if callable(op) else _ops.NAMED_OPS.index(op) + 1
        named = combine, w.OP_CODE[name] | (red << 4), _ops.plain_types(op)
        if type(op) is str:
            _NAMED_REDUCTIONS[(name, op)] = named
    # the usual operand, a number or a few of the op's plain types, passes here; anything
    # else is looked at by check_operand (and, in a data-only group, by the codec)
    plain, t = named[2], type(obj)
    if (t in plain or (t is tuple or t is list) and len(obj) <= 16
            and plain.issuperset(map(type, obj))) and core.codec != w.MSGPACK:
        return named[0], named[1], obj
    try:
        _ops.check_operand(op, obj, name, core.rank)
        if core.codec == w.MSGPACK:
            _encodable(core, [obj], name)
    except (InvalidArgumentError, CodecError) as e:  # (the same for an unencodable one)
        return named[0], named[1], _ops.Failed(str(e), "operand")
    return named[0], named[1], obj


def _spec_reduce(core: Core, obj: Any, op: Any, dst: int) -> Call:
    root = _rank_arg(core, dst, "dst", "reduce")
    combine, code, obj = _reduction(core, "reduce", obj, op)
    # (a callable may not commute: folded in rank order, as MPI does; the named ops commute)
    return Call("reduce", choose("reduce", core.size), (obj, combine, root, callable(op)),
                code, root, True)


def _spec_all_reduce(core: Core, obj: Any, op: Any) -> Call:
    combine, code, obj = _reduction(core, "all_reduce", obj, op)
    return _new_call(Call, ("all_reduce", choose("all_reduce", core.size), (obj, combine),
                            code, w.NO_ROOT, True))


def _spec_all_to_all(core: Core, objs: Any) -> Call:
    mine = _per_rank_or_failed(core, objs, "all_to_all")
    checked = core.codec == w.MSGPACK
    if checked:
        mine = _sendable_each(core, mine, "all_to_all")
    return Call("all_to_all", _plans.all_to_all, (mine,), w.OP_CODE["all_to_all"],
                w.NO_ROOT, True)


# the calls whose result is a list of the ranks' objects: one may be a rank's failure
_LISTS = frozenset(w.OP_CODE[n] for n in ("gather", "all_gather", "all_to_all"))


def _failed(call: Call, core: Core, result: _ops.Failed) -> CtrlcommError:
    cls = {"operand": OperandError, "codec": CodecError,
           "argument": InvalidArgumentError}.get(result.kind, ReductionError)
    where = result.where()
    e: CtrlcommError = cls(f"{call.name} on group {core.name!r} failed on rank {core.rank}: "
            f"{where + ': ' if where else ''}{result.message}")
    if isinstance(e, ReductionError) and result.sides:
        e.ranks = [*result.sides[0], *result.sides[1]]
    return e


def _reduced(call: Call, core: Core, r: Any) -> Any:
    """The result of a call that may carry a failure (a reduction; any call of a data-only
    group), or the failure raised: where the result came back failed, or holds a rank's
    failure, and on a rank whose own object failed (a ``reduce``'s or ``gather``'s other
    ranks get no result to tell them)."""
    if type(r) is _ops.Failed:
        raise _failed(call, core, r)
    if type(r) is list and call.opcode in _LISTS:
        for x in r:
            if type(x) is _ops.Failed:
                raise _failed(call, core, x)
    mine = call.args[0] if call.args else None
    if type(mine) is _ops.Failed:
        raise _failed(call, core, mine)
    if type(mine) is list and mine and type(mine[0]) is _ops.Failed:  # scatter, all_to_all
        raise _failed(call, core, mine[0])
    return r


# the types of a result or operand that may be or hold a failure (see _reduced): anything
# else is returned without a call of _reduced
_MAY_FAIL = frozenset({_ops.Failed, list})


def _run_sync(core: Core, call: Call, timeout: float | None) -> Any:
    r = run_sync(core, core.collective(call, None if timeout is None
                                       else _timeout_arg(timeout, call.name, core.rank)))
    if call.reduces and (type(r) in _MAY_FAIL or type(call.args[0]) in _MAY_FAIL):
        return _reduced(call, core, r)
    return r


async def _run_async(core: Core, call: Call, timeout: float | None) -> Any:
    t = None if timeout is None else _timeout_arg(timeout, call.name, core.rank)
    r = await run_async(core, core.collective(call, t), call.name, t)
    if call.reduces and (type(r) in _MAY_FAIL or type(call.args[0]) in _MAY_FAIL):
        return _reduced(call, core, r)
    return r


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


def _group_id(name: str, nonce: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{name}\0{nonce}".encode(), digest_size=8).digest(),
                          "little")


def _group_key(secret: str, group_id: int, auth_key: bytes | None) -> bytes:
    """The key every message and heartbeat of a group is MACed with: from the secret rank 0
    made at formation and gave the ranks that joined (its address table, which the store
    gives them only), and the ``auth_key`` where there is one (then a stranger who read the
    table off the wire still cannot make a frame)."""
    keyed = hashlib.blake2b(auth_key or b"", digest_size=32, person=b"ctrlcomm-auth").digest()
    return hashlib.blake2b(bytes.fromhex(secret) + group_id.to_bytes(8, "little"), key=keyed,
                           digest_size=32, person=b"ctrlcomm-group").digest()


def _bind_address(bind_host: Any, timeout: float, what: str = "bind_host") -> str:
    """``bind_host`` (an address to bind to, named ``what`` in errors) checked, as an
    address (a name looked up within ``timeout`` seconds): InvalidArgumentError where it
    does not resolve, TimeoutError where the lookup took longer."""
    host = _check_host(bind_host, what)
    try:
        return resolve(host, timeout)
    except TimeoutError:
        raise
    except (OSError, UnicodeError) as e:  # (socket.gaierror; OSError for EAI_SYSTEM)
        raise InvalidArgumentError(
            f"{what} {bind_host!r} does not resolve ({getattr(e, 'strerror', None) or e}): "
            "give an address of this machine, or '0.0.0.0' for every interface") from None


def _validate_world(rank: Any, world_size: Any) -> tuple[int, int]:
    try:  # (a bool is an int to Python, never a rank or a size: as in the collectives)
        if isinstance(world_size, bool):
            raise TypeError
        ws = operator.index(world_size)
    except TypeError:
        raise InvalidArgumentError(f"world_size must be an int, got {show(world_size)}") from None
    if ws < 1:
        raise InvalidArgumentError(f"world_size must be >= 1, got {ws}")
    try:
        if isinstance(rank, bool):
            raise TypeError
        r = operator.index(rank)
    except TypeError:
        raise InvalidArgumentError(f"rank must be an int, got {show(rank)}") from None
    if not 0 <= r < ws:
        raise InvalidArgumentError(f"rank {r} is out of range for world_size {ws} "
                                   f"(ranks are 0..{ws - 1})")
    return r, ws


# ------------------------------------------------------------------------------- groups


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
    and awaited calls may be mixed. A group is used by one thread (or coroutine) at a time: a
    second caller while one is inside gets :class:`ConcurrentUseError`; but awaited
    collectives of one event loop take turns, first come first (``asyncio.gather`` of
    several, one per task, runs them in the order their tasks started, on every rank).
    """

    _finalizer: weakref.finalize[Any, Any] | None = None

    def __init__(self, core: Core, *, store: StoreClient | None, server: StoreServer | None,
                 server_key: tuple[str, int] | None) -> None:
        self._core = core
        self.store = store
        self._server = server
        self._aio: weakref.ref[AioGroup] | None = None
        self._keep_server(server_key)

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
        host: str,
        port: int,
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
        _deadline: float | None = None,
    ) -> Group:
        """Form a group through the store at ``(host, port)``.

        Args:
            host: the store's address. By default rank 0 hosts the store there.
                ``"0.0.0.0"`` (or ``"::"``, on the store's host): the store, and the ranks
                given it, listen on every interface, and ranks on other hosts, given an
                address of that host, reach them there (as TRL's vLLM workers and trainer do).
            port: the store's port.
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
            transport: ``"tcp"`` (default without ``encrypt``: plain sockets, lowest
                latency) or ``"zmq"`` (ZeroMQ PUSH/PULL sockets; the default with
                ``encrypt``); ``None``: ``CTRLCOMM_TRANSPORT`` where it is set, which also
                reaches groups made for you (``StatelessProcessGroup``...). A send on "tcp"
                with more than 4 MiB queued for a peer returns once that peer has taken all
                but 4 MiB (the sender's process writes it); on "zmq" it returns at once
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
        host = _check_host(host, "host")
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
            if env is not None and env not in ("tcp", "zmq"):
                raise InvalidArgumentError(f"CTRLCOMM_TRANSPORT={env!r} names no transport; "
                                           "use 'tcp' or 'zmq'")
            transport = "zmq" if encrypt else (env or "tcp")
        if transport not in ("tcp", "zmq"):
            raise InvalidArgumentError(f"unknown transport {transport!r}; use 'tcp' or 'zmq'")
        if codec not in CODECS:
            raise InvalidArgumentError(f"unknown codec {codec!r}; use one of {sorted(CODECS)}")
        port = port_arg(port)
        if auth_key is not None and not auth_key:  # (given, but empty: a key read from an
            # empty file, say; an empty CTRLCOMM_AUTH_KEY is unset, as shells have it)
            raise InvalidArgumentError("Group.create: auth_key is empty; give a secret, or "
                                       "None for no authentication")
        key = auth_key_or_env(auth_key)
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
        rank0_hosts = host_store is None  # (for the error where the store answers nothing)
        if host_store is None:
            host_store = rank == 0
        # (_deadline: formation's, where it began before, as from_env's under torchrun)
        deadline = time.monotonic() + t if _deadline is None else _deadline
        live = None if liveness_timeout is None else _seconds(liveness_timeout)
        if live is not None and not live > 0:
            raise InvalidArgumentError(f"liveness_timeout must be > 0 or None, got "
                                       f"{show(liveness_timeout)}")
        beat = _seconds(heartbeat_interval)
        if not beat > 0:
            raise InvalidArgumentError(f"heartbeat_interval must be > 0, got "
                                       f"{show(heartbeat_interval)}")
        liveness_timeout, heartbeat_interval = live, beat
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
        server = _acquire_server(store_address, port, key, encrypt, store_limits) \
            if host_store else None
        # (counted from here, not from the rendezvous: a peer without the key may fail its
        # handshake as it connects, and where its ZeroMQ saw the mechanisms differ first,
        # it tries no more until its next request)
        dropped = server.dropped if server is not None else 0
        store = ep = hb = None
        try:
            store = StoreClient(host, port, timeout=t, prefix=f"ctrlcomm/{name}/",
                                auth_key=key, encrypt=encrypt, _address=store_address)
            # a store on every interface (host "0.0.0.0", as TRL's vLLM workers give it):
            # this rank is on the store's host (where a connection to 0.0.0.0 goes), and the
            # ranks elsewhere reach it by their own store address, which may be any interface
            # of this host: it binds every interface too, and publishes "*" for its address
            # (each peer reads the address it reaches the store by: _reachable)
            wild = _wildcard(store_address)
            if bind_host is None:
                bind_host = store_address if wild else local_address_for(store_address, port)
            warn_if_unkeyed(f"group {name!r}", bind_host, key)
            ep = make_endpoint(transport, bind_host, zmq_context=zmq_context, encrypt=encrypt)
            hb = Heartbeat(bind_host, 0, rank, None, float(heartbeat_interval))
            # "endpoint udp-port [unix:name@host] [curve:public-key] [proc:host:pid:start]":
            # this rank's line of the address table; the optional fields where this host has
            # Unix sockets, the group encrypts, or this host has /proc (a silent peer of this
            # host is looked up there: see Heartbeat.running)
            local = getattr(ep, "local_address", "")
            curve = getattr(ep, "curve_public", b"")
            proc = proc_address()
            # and what every rank must have alike, compared by rank 0 (a rank created with
            # another world size, codec or transport would wait, or fail, without saying why)
            # (and the wire format's version: a peer of another reads none of its messages)
            alike = f"ws:{world_size} codec:{codec} tr:{transport} wire:{w.VERSION}"
            address = ep.address
            if _wildcard(bind_host):
                # bound to every interface: peers are told the one that reaches the store
                # (the address bound, 0.0.0.0, would send a peer elsewhere to its own host),
                # or, where the store is on every interface too, "*" (see above)
                address = _tcp("*" if wild else local_address_for(store_address, port),
                               _parse_tcp(address)[1][1])
            # ("join:": this try's own, so that no later try reads this one's table as its
            # own, were its ports the same again)
            me = " ".join(filter(None, (address, str(hb.port), local,
                                        "curve:" + curve.decode() if curve else "", proc, alike,
                                        "join:" + os.urandom(6).hex())))
            try:
                nonce, secret, table = _rendezvous(store, me, rank, world_size, name, deadline,
                                                   rank0_hosts=rank0_hosts)
            except FormationTimeoutError as e:
                if server is not None and server.dropped > dropped and e.args:
                    # what a rank with another auth_key (or none) sent: it waits, unanswered
                    e.args = (f"{e.args[0]} (the store here dropped "
                              f"{server.dropped - dropped} requests or connections it could "
                              "not authenticate meanwhile: is a rank created with another "
                              "auth_key, or none?)",)
                if server is not None and e.missing and e.args \
                        and ipaddress.ip_address(store_address).is_loopback:
                    # (vLLM's TCPStore listens on every interface whatever its host: a rank
                    # 0 given 127.0.0.1 there reaches ranks given this host's address)
                    e.args = (f"{e.args[0]} (if they run on other hosts: the store here "
                              f"listens on the loopback address {store_address} only, which "
                              "they cannot reach; give rank 0 an address of this host that "
                              "they reach, or '0.0.0.0')",)
                raise
            fields = {r: line.split(" ") for r, line in table.items()}
            peers = {r: _reachable(f[0], store_address) for r, f in fields.items()}

            def extra(prefix: str) -> dict[int, str]:
                return {r: x for r, f in fields.items() for x in f[2:] if x.startswith(prefix)}

            if isinstance(ep, TcpEndpoint):
                ep.set_peers(peers, extra("unix:"))
            else:
                keys = {r: x[len("curve:"):].encode() for r, x in extra("curve:").items()}
                if encrypt and len(keys) < world_size:
                    raise FormationError(
                        f"group {name!r}: ranks {sorted(set(range(world_size)) - set(keys))} "
                        "published no encryption key (were they created without encrypt=True?)")
                ep.set_peers(peers, keys)
            gid = _group_id(name, nonce)
            mac_key = _group_key(secret, gid, key)
            hb.group_id, hb.key = gid, mac_key
            hb.start({r: (_host_of(peers[r]), int(line.split(" ")[1]))
                      for r, line in table.items() if r != rank},
                     same_host_procs(extra("proc:"), proc))
            core = Core(name=name, rank=rank, size=world_size, group_id=gid,
                        endpoint=ep, codec=CODECS[codec], key=mac_key, timeout=t,
                        heartbeat=hb,
                        liveness_timeout=None if liveness_timeout is None
                        else float(liveness_timeout))
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
        return cls(core, store=store, server=server,
                   server_key=(store_address, port) if server is not None else None)

    @classmethod
    def from_torch(cls, process_group: Any = None, **kwargs: Any) -> Group:
        """A group with the same ranks as a torch process group (``None``: the default group),
        formed through that group once. Needs ``pip install 'ctrlcomm[torch]'``; see
        :func:`ctrlcomm.torch.group_from_torch` for the options."""
        from .torch import group_from_torch

        return group_from_torch(process_group, **kwargs)

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
        return self._core.state == "closed"

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
        store.close()
    if server_key is not None:
        _release_server(*server_key)


# Objects collected unclosed: their finalizers queue what closes them (SimpleQueue.put is
# safe in a finalizer, which runs wherever the collector does: under any lock, in any
# thread), and one thread of the process does it.
_dropped: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...], int]] = \
    queue.SimpleQueue()
_closer: threading.Thread | None = None
_closer_lock = threading.Lock()


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


_transport.BEFORE_EXIT_FLUSH.append(_await_closer)


class _Awaited(Coroutine[Any, Any, Any]):
    """An awaited collective's coroutine, which knows whether it began.

    The coroutine of an ``async def`` that is cancelled before its first step (a task
    cancelled as it is made, ``asyncio.wait_for(..., 0)``, a deadline already spent) is
    closed without running any of its body: nothing would know of the call, the group
    would stay open, and this rank's next collective would pair with the others' this one
    (found in review: all_gather gave ``["second", "first"]`` on both ranks). asyncio runs
    this as it runs a coroutine (``send``/``throw``), so a cancellation before it began
    reaches it: the group breaks, and the others are told, as for one cancelled in its
    first turn (:func:`cancelled_before_it_began`). The call itself (its arguments
    checked) is made as it begins, as an ``async def``'s would be."""

    def __init__(self, core: Core, name: str, make: Callable[[], Coroutine[Any, Any, Any]],
                 owner: str = "AioGroup") -> None:
        self._core = core
        self._make: Callable[[], Coroutine[Any, Any, Any]] | None = make
        self._coro: Coroutine[Any, Any, Any] | None = None
        self.__name__ = name
        self.__qualname__ = f"{owner}.{name}"

    def _begun(self) -> Coroutine[Any, Any, Any]:
        coro = self._coro
        if coro is None:
            make, self._make = self._make, None
            if make is None:
                raise RuntimeError(f"cannot reuse already awaited coroutine {self.__qualname__}")
            coro = self._coro = make()
        return coro

    def send(self, value: Any) -> Any:
        return self._begun().send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if self._coro is None:
            if self._make is not None:
                self._make = None
                cancelled_before_it_began(self._core, self.__name__)
            e = typ if isinstance(typ, BaseException) else typ() if val is None else val
            raise e.with_traceback(tb) if tb is not None else e
        if val is None and tb is None:  # (the form asyncio uses; three are deprecated)
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)

    def close(self) -> None:
        # (never awaited: no call was made, as with an async def's coroutine)
        self._make = None
        if self._coro is not None:
            self._coro.close()

    def __del__(self) -> None:
        if getattr(self, "_make", None) is not None:  # (as Python says of an async def's)
            warnings.warn(f"coroutine '{self.__qualname__}' was never awaited",
                          RuntimeWarning, stacklevel=2)

    def __await__(self) -> Generator[Any, None, Any]:
        return self._begun().__await__()


_F = TypeVar("_F", bound=Callable[..., Any])


def _coroutine_function(fn: _F) -> _F:
    """Mark ``fn``, which returns an :class:`_Awaited`, as a coroutine function for the
    code that asks (``inspect.iscoroutinefunction`` from Python 3.12,
    ``asyncio.iscoroutinefunction``), as the ``async def`` it was."""
    mark = getattr(inspect, "markcoroutinefunction", None)
    if mark is not None:
        return mark(fn)  # type: ignore[no-any-return]
    marker = getattr(asyncio.coroutines, "_is_coroutine", None)
    if marker is not None:
        fn._is_coroutine = marker  # type: ignore[attr-defined]
    return fn


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


# ---------------------------------------------------------------------------- rendezvous


def _host_of(endpoint: str) -> str:
    return endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")


def _reachable(endpoint: str, store_address: str) -> str:
    """A peer's published address as this rank connects to it: as it is, but for ``*``, a
    rank on the store's host bound to every interface, reached at the address this rank
    reaches the store by; where that is a wildcard too (this rank is on that host) at
    127.0.0.1, which a rank bound to 0.0.0.0 and one bound to :: (both families: see
    _transport._dual_stack) both take."""
    if not endpoint.startswith("tcp://*:"):
        return endpoint
    host = "127.0.0.1" if _wildcard(store_address) else store_address
    return _tcp(host, endpoint.rsplit(":", 1)[1])


def _missing_ranks(store: StoreClient, ranks: Sequence[int], budget: float, token: str
                   ) -> tuple[list[int], list[int]]:
    """Of ``ranks``, those whose key is absent: (never joined, joined and gave up in this
    try: their mark, :data:`GAVE_UP`, holds ``token``, rank 0's of this try); ([], []) when
    the store cannot tell within ``budget`` s."""
    end = time.monotonic() + budget
    n = len(ranks)
    try:
        have = store.exists([f"{FORMATION}rank/{r}" for r in ranks]
                            + [f"{GAVE_UP}{r}" for r in ranks], timeout=budget)
        absent = [i for i in range(n) if not have[i]]
        marked = [i for i in absent if have[n + i]] if token else []
        marks = store.multi_get([f"{GAVE_UP}{ranks[i]}" for i in marked], wait=False,
                                timeout=max(end - time.monotonic(), 0.001)) if marked else []
    except (StoreError, KeyError):  # (KeyError: a mark deleted meanwhile)
        return [], []
    gave = {ranks[i] for i, v in zip(marked, marks, strict=True) if v.decode(errors="replace")
            == token}
    return [ranks[i] for i in absent if ranks[i] not in gave], sorted(gave)


def _joined_from(address: bytes) -> str:
    """Where the process of an address line (another's, of this rank) joined from, in words:
    its endpoint, and its pid where it runs on this host (its line's ``proc:`` field)."""
    fields = address.decode(errors="replace").split(" ")
    where = f"from {fields[0]}" if fields[0] else "from an unknown address"
    proc = next((f.split(":") for f in fields if f.startswith("proc:")), [])
    mine = proc_address().split(":")
    if len(proc) == 4 and len(mine) == 4:
        if proc[1] == mine[1]:
            return f"{where} by process {proc[2]} of this host"
        return f"{where} by a process of another host (or PID namespace)"
    return where


def _token(address: str) -> str:
    """The "join:" field of an address line: its try's own ("" from a release without)."""
    return next((f for f in address.split(" ") if f.startswith("join:")), "")


def _not_joined(missing: list[int], gave_up: list[int]) -> str:
    """Which ranks are not in, in words (of :func:`_missing_ranks`)."""
    parts = [f"ranks {missing} did not join"] if missing else []
    if gave_up:
        parts.append(f"ranks {gave_up} joined and gave up before (at their own deadline, "
                     "or on an error)")
    return "; ".join(parts)


ALIKE = ("ws:", "codec:", "tr:", "wire:")  # the fields of an address every rank must have alike
_ALIKE_WORDS = {"ws": "world size", "codec": "codec", "tr": "transport", "wire": "wire version"}
ASK_S = 0.5  # how long a formation that timed out asks the store why
SETTLE_S = 2.0  # how long rank 0 waits for the others to read that the group is formed
DIFFER_CHECK_S = 1.0  # how often rank 0, waiting for ranks, compares the settings of those in
# Where, in a group's namespace of the store, formation keeps its keys (deleted once the group
# is formed): apart from the keys the ranks set through the group's store client (Group.store)
FORMATION = "ctrlcomm:formation/"
# The mark a rank leaves where it withdraws its key (_withdraw), so that the others, timing out
# at their own deadlines moments later, name it as gone, not as never come. It holds the token
# of rank 0's address line it knew: only a mark of the try a rank is in counts (one of an
# earlier try of this name, never deleted where that try failed, does not).
GAVE_UP = f"{FORMATION}gave-up/"


def _alike(address: str) -> dict[str, str]:
    return dict(f.split(":", 1) for f in address.split(" ")[2:] if f.startswith(ALIKE))


def _differ(name: str, mine: str, records: dict[int, str]) -> str:
    """What ranks of ``records`` were created with otherwise than rank 0 (``mine``), in
    words; "" if nothing."""
    own = _alike(mine)
    words = _ALIKE_WORDS
    seen = set(own)  # the fields any rank has
    parts = []
    for r, rec in sorted(records.items()):
        theirs = _alike(rec)
        seen.update(theirs)
        # (a field one side lacks differs too: a rank of an earlier version has no "wire:")
        diff = [f"{words[k]} {theirs.get(k, '?')}" for k in words
                if (k in own or k in theirs) and theirs.get(k) != own.get(k)]
        if diff:
            parts.append(f"rank {r} with {', '.join(diff)}")
    if not parts:
        return ""
    return (f"group {name!r}: the ranks were created with different settings: rank 0 with "
            + ", ".join(f"{words[k]} {own.get(k, '?')}" for k in words if k in seen)
            + "; " + "; ".join(parts))


def _silent_store(store: StoreClient, name: str, rank: int, rank0_hosts: bool,
                  rank0_joined: bool = False) -> FormationStoreTimeoutError:
    """The error of a formation whose store answered nothing by the deadline
    (``rank0_joined``: this rank had read rank 0's key)."""
    where = f"the store at {store.host}:{store.port}"
    keyed = store.keyed
    key = (" (or it runs with another auth_key than this rank's: a store answers nothing "
           "it cannot authenticate)") if keyed else \
        " (or it runs with an auth_key, and this rank has none: it answers nothing unsigned)"
    head = f"group {name!r} not formed within the timeout on rank {rank}: {where}"
    if rank0_hosts and rank0_joined:
        return FormationStoreTimeoutError(
            f"{head}, which rank 0 hosts, answered nothing: rank 0, which had joined, is gone "
            "(it gave up at its own deadline, or exited), its store with it; which other "
            "ranks did not join is not known", gave_up=[0])
    if rank0_hosts:
        return FormationStoreTimeoutError(
            f"{head}, which rank 0 hosts, answered nothing: rank 0 did not come, or is gone "
            f"(is it alive, and created with this host and port?){key}", missing=[0])
    return FormationStoreTimeoutError(
        f"{head} answered nothing (is it running, at this address?){key}")


def _rendezvous(store: StoreClient, address: str, rank: int, size: int, name: str,
                deadline: float, rank0_hosts: bool = True) -> tuple[str, str, dict[int, str]]:
    """Publish this rank's address; return (nonce, secret, {rank: address}) of the formed
    group.

    Rank 0 waits for every rank's key, gives each rank the group's secret (a key of its own,
    which the store lets that rank only read: see ``StoreState``), publishes the table
    (nonce and addresses, plain text: nothing here is ever unpickled; or, where the ranks'
    settings differ, ``!`` and what differs) and, once every rank has read it, deletes the
    table and its own key (each other
    rank deleted its own as it read the table). A rank that times
    out asks the store why for at most :data:`ASK_S` more (a store that does not answer
    at all takes its reply slack more, ``REPLY_SLACK_S``). A rank whose formation fails
    takes its key back (and rank 0 its table), so that it can try again with the same name
    (:func:`_withdraw`); the acknowledgements are counted per table (its nonce), so that a
    late one of a failed try never counts toward the next. ``rank0_hosts``: whether the store
    is rank 0's (Group.create's default), for the error where it answers nothing.
    """
    try:
        ok, held = store.set_if_absent(f"{FORMATION}rank/{rank}", address,
                                       timeout=max(deadline - time.monotonic(), 0.001))
    except StoreTimeoutError as e:
        if e.answered:
            raise
        raise _silent_store(store, name, rank, rank0_hosts) from None
    if not ok:
        raise FormationError(
            f"group {name!r}: rank {rank} already joined, {_joined_from(held)} (two "
            "processes with one rank, or a stale key of an earlier group of that name: "
            "use another name or a fresh store)")
    # what _join did that a failure must undo, or keep: "table" (rank 0 published an
    # address table), "differ" (the ranks' settings differ: the keys stay, see _withdraw)
    # (and "rank0": the token of rank 0's address line, once known)
    done: dict[str, str] = {"rank0": _token(address)} if rank == 0 else {}
    try:
        return _join(store, address, rank, size, name, deadline, done, rank0_hosts)
    except BaseException:
        if "differ" not in done:
            _withdraw(store, rank, "table" in done, done.get("rank0", ""))
        raise


def _withdraw(store: StoreClient, rank: int, table: bool, token: str) -> None:
    """After a failed formation, best effort, briefly: delete this rank's key and (rank 0,
    ``table``) the address table it published. A key left behind made the next try of
    this rank fail at once ("already joined"), or a rank 0 coming later pair it with the
    address of the process that gave up. (Not where the ranks' settings differ: rank 0
    names the ranks created otherwise from their keys, and a table that says so is for
    the others to read; a try again needs the settings changed, or another name.) It
    leaves its mark (:data:`GAVE_UP`), with ``token``, rank 0's, where it knew it."""
    try:  # (the mark first: a rank asking in between finds one or the other)
        if token:
            store.set(f"{GAVE_UP}{rank}", token, timeout=ASK_S)
        if table:  # (while this rank's key is there: the table is rank 0's to delete)
            store.delete_prefix(f"{FORMATION}secret/", timeout=ASK_S)
            store.delete(f"{FORMATION}table", timeout=ASK_S)
        store.delete(f"{FORMATION}rank/{rank}", timeout=ASK_S)
    except (StoreError, OSError):
        pass  # (the store is gone, or does not answer: nothing to clean, or no way to)


def _wait_for_ranks(store: StoreClient, keys: list[str], name: str, address: str,
                    deadline: float, done: dict[str, str]) -> None:
    """Rank 0: wait until every rank's key is set (raises the last StoreTimeoutError at the
    deadline). Every :data:`DIFFER_CHECK_S` s meanwhile it compares the settings of the ranks
    that joined with its own: where one differs (a rank created with another world size,
    say), that rank has failed already, and no try of it can join this formation (its key
    stays, see :func:`_withdraw`), so rank 0 publishes what differs for the ranks waiting
    with it, as where all had joined, and raises FormationError at once. (It waited out its
    whole deadline, for a rank that a smaller world size never starts.)"""
    while True:
        left = deadline - time.monotonic()
        last = left <= DIFFER_CHECK_S
        try:
            store.wait(keys, timeout=max(left, 0.001) if last else DIFFER_CHECK_S)
            return
        except StoreTimeoutError as e:
            if last or not e.answered:
                raise
        try:
            have = store.exists(keys[1:], timeout=ASK_S)
            joined = [k for k, h in zip(keys[1:], have, strict=True) if h]
            got = store.multi_get(joined, wait=False, timeout=ASK_S) if joined else []
        except (StoreError, KeyError):  # (KeyError: a rank withdrew meanwhile; next time)
            continue
        differ = _differ(name, address, {int(k.rsplit("/", 1)[1]): v.decode(errors="replace")
                                         for k, v in zip(joined, got, strict=True)})
        if differ:
            done["differ"] = ""
            try:
                store.set(f"{FORMATION}table", "!" + differ, timeout=ASK_S)
            except StoreError:
                pass  # (the others then say it at their deadlines)
            raise FormationError(differ)


def _join(store: StoreClient, address: str, rank: int, size: int, name: str,
          deadline: float, done: dict[str, str], rank0_hosts: bool = True
          ) -> tuple[str, str, dict[int, str]]:
    """:func:`_rendezvous` once this rank's key is set; ``done``: see there."""

    def left() -> float:
        return max(deadline - time.monotonic(), 0.001)

    keys = [f"{FORMATION}rank/{r}" for r in range(size)]
    if rank == 0:
        try:
            _wait_for_ranks(store, keys, name, address, deadline, done)
        except StoreTimeoutError as e:
            missing: list[int] = []
            gave_up: list[int] = []
            joined: list[str] = []
            if e.answered:  # (a store that answered nothing is not asked: it would take as long)
                missing, gave_up = _missing_ranks(store, range(size), ASK_S, done["rank0"])
                joined = [k for r, k in enumerate(keys)
                          if r not in missing and r not in gave_up and r != 0]
            differ = ""
            if joined:  # (those of another world size, say: ranks beyond theirs never come)
                try:
                    got = store.multi_get(joined, wait=False, timeout=ASK_S)
                    differ = _differ(name, address, {int(k.rsplit("/", 1)[1]): v.decode()
                                                     for k, v in zip(joined, got, strict=True)})
                except (StoreError, KeyError):
                    pass
            if differ:
                done["differ"] = ""  # (rank 0's key stays: a rank coming later compares)
            raise FormationTimeoutError(
                f"group {name!r} not formed within the timeout: "
                + (_not_joined(missing, gave_up) or "the store could not tell which ranks "
                   "did not join") + (f" ({differ})" if differ else ""),
                missing=missing, gave_up=gave_up) from None
        addrs = [a.decode() for a in store.multi_get(keys, timeout=left())]
        differ = _differ(name, address, dict(enumerate(addrs)))
        if differ:
            done["differ"] = ""
            store.set(f"{FORMATION}table", "!" + differ, timeout=left())
            raise FormationError(differ)
        nonce, secret = os.urandom(8).hex(), os.urandom(32).hex()
        done["table"] = ""
        for r in range(1, size):
            store.set(f"{FORMATION}secret/{r}", secret, timeout=left())
        store.set(f"{FORMATION}table", "\n".join([nonce, *addrs]), timeout=left())
        if size > 1:
            _settled(store, nonce, rank, size, name, deadline, rank0_hosts=rank0_hosts)
        # this formation's keys only: the ranks may have set keys of their own already,
        # through the group's store client, since they read the table; and, having closed
        # the group at once, one may be in the next formation of this name already (a
        # prefix deleted would take its key). Each other rank deleted its own key (and
        # the last to read the settlement its counters: _settled).
        try:  # (best effort: formed; rank 0's wait in _settled may have reached the deadline)
            store.multi_delete([keys[0], f"{FORMATION}table",
                                *(f"{GAVE_UP}{r}" for r in range(size)),
                                *(f"{FORMATION}secret/{r}" for r in range(1, size))],
                               timeout=ASK_S)
        except StoreError:
            pass
        return nonce, secret, dict(enumerate(addrs))
    # rank 0's settings, as soon as it has joined: a rank created otherwise says so at once
    # (rank 0, waiting for ranks that never come, says it at its deadline)
    try:
        first = store.get(keys[0], timeout=left()).decode()
    except StoreTimeoutError as e:
        if not e.answered:
            raise _silent_store(store, name, rank, rank0_hosts) from None
        raise FormationTimeoutError(
            f"group {name!r} not formed within the timeout on rank {rank}: rank 0 did not "
            "join (is rank 0 alive, and its store? If they are, the group was perhaps formed "
            f"already without this process: with another process of rank {rank}, or before "
            "this one came; a formed group leaves no trace in the store)", missing=[0]) from None
    done["rank0"] = _token(first)
    differ = _differ(name, first, {rank: address})
    if differ:
        done["differ"] = ""
        raise FormationError(differ)
    while True:
        try:
            text = store.get(f"{FORMATION}table", timeout=left()).decode()
        except StoreTimeoutError as e:
            if not e.answered:
                raise _silent_store(store, name, rank, rank0_hosts, rank0_joined=True) \
                    from None
            missing, gave_up = _missing_ranks(store, range(size), ASK_S, done["rank0"])
            why = _not_joined(missing, gave_up) or \
                "rank 0 published no address table (is rank 0 alive, and its store?)"
            raise FormationTimeoutError(
                f"group {name!r} not formed within the timeout on rank {rank}: {why}",
                missing=missing, gave_up=gave_up) from None
        if text.startswith("!"):  # rank 0 found the ranks' settings differ
            done["differ"] = ""
            raise FormationError(text[1:])
        lines = text.split("\n")
        if len(lines) == size + 1 and lines[1 + rank] == address:  # else: a stale table
            break
        if time.monotonic() >= deadline:  # a stale table, of an earlier try or group
            raise FormationTimeoutError(
                f"group {name!r} not formed within the timeout on rank {rank}: the address "
                "table in the store does not hold this rank's address (rank 0 published it "
                "for an earlier try of this rank, or for an earlier group of this name): "
                "try again")
        time.sleep(0.05)
    nonce = lines[0]
    try:  # (set before the table was: there, unless the table is another try's)
        secret = store.get(f"{FORMATION}secret/{rank}", wait=False, timeout=left()).decode()
        store.delete(f"{FORMATION}secret/{rank}", timeout=min(left(), ASK_S))
    except KeyError:
        raise FormationError(f"group {name!r}: rank 0 published the address table without "
                             f"this rank's secret (rank {rank}): a store of an earlier "
                             "version, or a table of another try; try again") from None
    # its key, read, first (rank 0 leaves it: this rank's next formation of this name, right
    # after a close, may have set it again by then; this one must find it gone; and a rank
    # whose key is still there when the wait runs out has not read the table). Before the
    # acknowledgement: once the last one is in, rank 0 may return, and its next formation
    # of this name take a key still there for this rank's next. Best effort
    try:
        store.delete(keys[rank], timeout=min(left(), ASK_S))
    except StoreError:
        pass
    known = None
    if store.add(f"{FORMATION}acks/{nonce}", 1, timeout=left()) == size - 1:
        # the last to read it: the group is formed, unless a rank whose wait ran out
        # settled it first (as failed)
        ok, held = store.set_if_absent(f"{FORMATION}done/{nonce}", "1", timeout=left())
        known = b"1" if ok else held
    _settled(store, nonce, rank, size, name, deadline, known, rank0_hosts)
    return nonce, secret, dict(enumerate(lines[1:]))


def _settled(store: StoreClient, nonce: str, rank: int, size: int, name: str,
             deadline: float, known: bytes | None = None, rank0_hosts: bool = True) -> None:
    """Wait until the formation of table ``nonce`` is settled, and raise
    FormationTimeoutError where it failed. Every rank reads the one value its store holds,
    set once (``set_if_absent``): "1" by the last rank to read the table (formed), or
    "!rank|why" by the first rank whose wait ran out (failed; why names the ranks that had
    not read the table, where the store can tell: they joined, so they are not
    ``missing``). So no rank's group is formed where another's is not. (Before, a rank
    that had read the table returned a group while rank 0 failed, waiting for a rank that
    had died after joining; its first call then blamed rank 0, "stopped answering
    heartbeats", not the rank that had died.) ``known``: the value, where this rank set
    it, or found it set, as the last to read the table.

    Formed, rank 0 returns once every rank has read the value (the last sets ``all-seen``),
    or after SETTLE_S: its store (where it hosts it) may end with its return (from_torch
    closes it), and a rank that read the value after that would fail where the others
    formed; and a rank that died after it read the table is its group's to find, as one
    that died just after formation, not rank 0's to wait for. Then rank 0 deletes the value
    and the formation's counters; failed, the last rank to read it. Where rank 0 stopped
    waiting, or a rank never read it, they stay (up to four small keys): a rank slow to read
    the value must still find it."""
    done, seen, all_seen = (f"{FORMATION}{k}/{nonce}" for k in ("done", "seen", "all-seen"))
    got = known
    if got is None:
        try:
            got = store.get(done, timeout=max(deadline - time.monotonic(), 0.001))
        except StoreTimeoutError as e:
            if not e.answered:  # (rank 0, which hosts it, is gone: formed or not)
                raise _silent_store(store, name, rank, rank0_hosts, rank0_joined=True) \
                    from None
            # the ranks whose keys are still there did not read the table (each deletes
            # its own once it has: _join)
            others = [r for r in range(1, size) if r != rank]
            try:
                have = store.exists([f"{FORMATION}rank/{r}" for r in others], timeout=ASK_S)
                late = [r for r, h in zip(others, have, strict=True) if h]
            except StoreError:
                late = []
            why = (f"ranks {late} did not read the address table in time (they joined, "
                   "then died or hung?)" if late
                   else "not every rank read the address table in time")
            failed = f"!{rank}|{why}".encode()
            ok, held = store.set_if_absent(done, failed, timeout=ASK_S)
            got = failed if ok else held
    keys = [f"{FORMATION}acks/{nonce}", done, seen, all_seen]
    try:  # (best effort: the formation is settled; rank 0's store may be gone)
        if store.add(seen, 1, timeout=ASK_S) == size:
            # every rank has read it (so acknowledged the table: none can count again)
            if rank == 0 or got != b"1":
                store.multi_delete(keys, timeout=ASK_S)
            else:
                store.set(all_seen, "1", timeout=ASK_S)  # (rank 0, waiting, deletes them)
        elif rank == 0 and got == b"1":
            store.wait([all_seen], timeout=min(max(deadline - time.monotonic(), 0.001),
                                               SETTLE_S))
            store.multi_delete(keys, timeout=ASK_S)
        # (failed, and not all have read it: the value stays for the others to read; a
        # rank that acknowledged late counted anew, and formed alone, where rank 0 deleted
        # the counters)
    except StoreError:
        pass
    if got != b"1":
        finder, _, why = got[1:].decode(errors="replace").partition("|")
        raise FormationTimeoutError(
            f"group {name!r} not formed within the timeout on rank {rank}: {why}"
            + ("" if finder == str(rank) else f" (found by rank {finder})"))


__all__ = ["Group", "AioGroup", "StoreError"]
