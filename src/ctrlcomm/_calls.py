"""A call's arguments checked, and its spec (plan, arguments, names): what Group and AioGroup
do before a collective runs, and what they make of its result (a rank's failure raised)."""

from __future__ import annotations

import functools
import logging
import operator
import os
from collections.abc import Callable, Iterable, Mapping, Sequence, Sized
from collections.abc import Set as AbstractSet
from typing import Any

from . import _ops, _plans
from . import _wire as w
from ._aio import run_async
from ._algo import choose
from ._core import Call, Core
from ._drivers import run_sync
from ._errors import (
    CodecError,
    CtrlcommError,
    InvalidArgumentError,
    OperandError,
    ReductionError,
    show,
)
from .rendezvous._client import _secs

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


# Tags a user may not give: ctrlcomm's own messages on a group (a shrink's, which run on a
# broken group too: see _elastic)
RESERVED_TAGS = frozenset({-(1 << 63), -(1 << 63) + 1})


def _tag_arg(core: Core, tag: Any, op: str) -> int:
    if type(tag) is int and -(1 << 63) + 1 < tag < (1 << 63):  # the usual
        return tag
    try:
        t = operator.index(tag)
    except TypeError:
        raise InvalidArgumentError(f"{op} on rank {core.rank}: tag must be an int, "
                                   f"got {show(tag)}") from None
    if not -(1 << 63) <= t < (1 << 63):
        raise InvalidArgumentError(f"{op} on rank {core.rank}: tag {t} out of range (int64)")
    if t in RESERVED_TAGS:
        raise InvalidArgumentError(f"{op} on rank {core.rank}: tag {t} is reserved for "
                                   "ctrlcomm's own messages (Group.shrink)")
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
                                       else _timeout_arg(timeout, call.name, core.rank)),
                 call.name)
    if call.reduces and (type(r) in _MAY_FAIL or type(call.args[0]) in _MAY_FAIL):
        return _reduced(call, core, r)
    return r


async def _run_async(core: Core, call: Call, timeout: float | None) -> Any:
    t = None if timeout is None else _timeout_arg(timeout, call.name, core.rank)
    r = await run_async(core, core.collective(call, t), call.name, t)
    if call.reduces and (type(r) in _MAY_FAIL or type(call.args[0]) in _MAY_FAIL):
        return _reduced(call, core, r)
    return r


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
