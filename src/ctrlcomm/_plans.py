"""Collective algorithms as I/O-free plans.

Theory of operation: a plan is a generator. It yields :class:`Step` objects, each a batch of
sends (destination, object) and a set of ranks to receive from in that step's round; the driver
performs the sends, waits until one message from each listed rank has arrived for
(this collective's seq, the step's round), and sends the generator a dict ``{src: object}``.
The generator's return value is the collective's result. Plans never touch sockets or clocks,
so the blocking driver, the asyncio driver and the in-memory simulator
(:mod:`ctrlcomm.testing`) all run the very same code.

Every algorithm is correct for any world size >= 1:

- barrier: dissemination, ceil(log2 N) rounds of one message.
- broadcast / scatter / gather / reduce: binomial trees rooted anywhere, ceil(log2 N) depth
  (reduce with a callable op: rooted at rank 0, folding in rank order, then one hop to the root).
- all_reduce: recursive doubling with the usual fold for non-powers of two (ranks beyond the
  largest power of two hand their value to a partner first and get the result last), or a
  flat one-round exchange for small worlds; every rank combines in the same order, so float
  results are bitwise identical on all ranks.
- all_gather: Bruck/dissemination, ceil(log2 N) rounds, or flat for small worlds.
- all_to_all: one round of direct sends (each rank has N-1 distinct payloads to deliver).
- one- and two-hop variants (star, flat) for small worlds: see the end of this module; which
  algorithm runs is chosen in :mod:`ctrlcomm._algo`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any, NamedTuple

from ._ops import Failed

Plan = Generator["Step", dict[int, Any], Any]


class Step(NamedTuple):
    """Send these, then receive one message from each rank in ``recvs``, tagged ``round``.
    (A named tuple: immutable, and built several times faster than a frozen dataclass; a
    call builds one or two.)"""

    round: int
    sends: tuple[tuple[int, Any], ...] = ()
    recvs: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Ctx:
    rank: int
    size: int


def _to(dsts: Iterable[int], obj: Any) -> tuple[tuple[int, Any], ...]:
    """The sends of one object to each of ``dsts`` (built in C: no generator to resume per
    destination, which a root's fan-out would pay on every call)."""
    return tuple(zip(dsts, repeat(obj)))


def fold(combine: Callable[[Any, Any], Any], vals: Sequence[Any]) -> Any:
    """``vals``, the ranks' operands in rank order, combined left to right:
    ``combine(combine(vals[0], vals[1]), vals[2])`` and so on; by ``combine.fold(vals)``,
    where it has one (a named op's: one pass instead of a call per operand, which a star's
    root makes N-1 of on every call). A combination that fails gives its failure the ranks
    it combined (ranks 0..i-1 with rank i)."""
    many = getattr(combine, "fold", None)
    if many is not None and len(vals) > 2:  # (two: one call costs less than the pass)
        acc = many(vals)
        if type(acc) is not Failed:
            return acc
        # (a named op's fold is pure: again pairwise, to find the combination that failed)
    acc = vals[0]
    for i in range(1, len(vals)):
        acc = combine(acc, vals[i])
        if type(acc) is Failed:
            return acc.at(range(i), (i,))
    return acc


def _block(lo: int, size: int, n: int, top: int) -> range | list[int]:
    """The ranks of virtual ranks ``lo`` .. ``lo + size - 1`` (capped at ``n``) of a tree
    rooted at ``top``."""
    hi = min(lo + size, n)
    return range(lo, hi) if top == 0 else [(v + top) % n for v in range(lo, hi)]


@functools.lru_cache(maxsize=1024)
def _others(n: int, r: int) -> tuple[int, ...]:
    """The ranks of a world of ``n`` but ``r``, in order (built once per (n, r): a generator
    expression would be resumed once per rank on every call)."""
    return tuple(range(r)) + tuple(range(r + 1, n))


def _ceil_log2(n: int) -> int:
    return (n - 1).bit_length()


def barrier(ctx: Ctx) -> Plan:
    n, r = ctx.size, ctx.rank
    for k in range((n - 1).bit_length()):  # ceil(log2(n)) rounds
        d = 1 << k
        yield Step(k, (((r + d) % n, None),), ((r - d) % n,))
    return None


def _tree_parent(vr: int, n: int) -> tuple[int, int]:
    """(parent virtual rank or -1, mask of this node's subtree) in a binomial tree."""
    mask = 1
    while mask < n:
        if vr & mask:
            return vr - mask, mask
        mask <<= 1
    return -1, mask


def _tree_children(vr: int, n: int, mask: int) -> list[int]:
    """Children of ``vr``, largest subtree first."""
    out = []
    m = mask >> 1
    while m > 0:
        if vr + m < n:
            out.append(vr + m)
        m >>= 1
    return out


def broadcast(ctx: Ctx, obj: Any, root: int) -> Plan:
    n = ctx.size
    vr = (ctx.rank - root) % n
    parent, mask = _tree_parent(vr, n)
    if parent >= 0:
        src = (parent + root) % n
        got = yield Step(0, recvs=(src,))
        obj = got[src]
    kids = _tree_children(vr, n, mask)
    if kids:
        yield Step(0, sends=tuple(((c + root) % n, obj) for c in kids))
    return obj


def gather(ctx: Ctx, obj: Any, root: int) -> Plan:
    n = ctx.size
    vr = (ctx.rank - root) % n
    parent, mask = _tree_parent(vr, n)
    have: dict[int, Any] = {ctx.rank: obj}
    kids = _tree_children(vr, n, mask)
    if kids:
        got = yield Step(0, recvs=tuple((c + root) % n for c in kids))
        for part in got.values():
            have.update(part)
    if parent >= 0:
        yield Step(0, sends=(((parent + root) % n, have),))
        return None
    return [have[i] for i in range(n)]


def scatter(ctx: Ctx, objs: Sequence[Any] | None, root: int) -> Plan:
    n = ctx.size
    vr = (ctx.rank - root) % n
    parent, mask = _tree_parent(vr, n)
    if parent < 0:
        assert objs is not None
        mine = {v: objs[(v + root) % n] for v in range(n)}  # keyed by virtual rank
    else:
        src = (parent + root) % n
        got = yield Step(0, recvs=(src,))
        mine = got[src]
    kids = _tree_children(vr, n, mask)
    if kids:
        sends = []
        for c in kids:
            span = c - vr  # child c owns virtual ranks [c, c + span)
            sends.append(((c + root) % n, {v: mine[v] for v in range(c, min(c + span, n))}))
        yield Step(0, sends=tuple(sends))
    return mine[vr]


def reduce(ctx: Ctx, obj: Any, combine: Callable[[Any, Any], Any], root: int,
           ordered: bool = True) -> Plan:
    """A binomial tree. ``ordered`` (an op that may not commute: a user's callable; MPI
    folds in rank order, and concatenation is associative without commuting): the tree is
    rooted at rank 0, which folds in rank order, and rank 0 hands the result to the root,
    one more hop where that is another rank (as MPICH for such ops). Else (the named ops,
    which commute) rooted at the root, whose fold runs root..n-1, 0..root-1."""
    n = ctx.size
    top = 0 if ordered else root
    vr = (ctx.rank - top) % n
    parent, mask = _tree_parent(vr, n)
    kids = _tree_children(vr, n, mask)
    acc = obj
    if kids:
        got = yield Step(0, recvs=tuple((c + top) % n for c in kids))
        # children in increasing virtual rank: acc covers [vr, c) in rank order, child c
        # [c, c + (c - vr))
        for c in reversed(kids):
            acc = combine(acc, got[(c + top) % n])
            if type(acc) is Failed:
                acc = acc.at(_block(vr, c - vr, n, top), _block(c, c - vr, n, top))
    if parent >= 0:
        yield Step(0, sends=(((parent + top) % n, acc),))
        if ctx.rank != root:
            return None
        got = yield Step(1, recvs=(top,))
        return got[top]
    if root != top:
        yield Step(1, sends=((root, acc),))
        return None
    return acc


def all_reduce_flat(ctx: Ctx, obj: Any, combine: Callable[[Any, Any], Any]) -> Plan:
    n, r = ctx.size, ctx.rank
    if n == 1:
        return obj
    peers = _others(n, r)
    got = yield Step(0, _to(peers, obj), peers)
    got[r] = obj
    return fold(combine, list(map(got.__getitem__, range(n))))


def all_reduce_doubling(ctx: Ctx, obj: Any, combine: Callable[[Any, Any], Any]) -> Plan:
    n, r = ctx.size, ctx.rank
    if n == 1:
        return obj
    p = 1 << (n.bit_length() - 1)  # largest power of two <= n
    rem = n - p
    acc = obj
    # fold: among the first 2*rem ranks, even ones hand their value to the next odd one
    if r < 2 * rem:
        if r % 2 == 0:
            yield Step(0, sends=((r + 1, acc),))
            got = yield Step(_ceil_log2(p) + 1, recvs=(r + 1,))
            return got[r + 1]
        got = yield Step(0, recvs=(r - 1,))
        acc = combine(got[r - 1], acc)
        if type(acc) is Failed:
            acc = acc.at((r - 1,), (r,))
        newrank = r // 2
    else:
        newrank = r - rem

    def real(nr: int) -> int:
        return nr * 2 + 1 if nr < rem else nr + rem

    mask, rnd = 1, 1
    while mask < p:
        partner = real(newrank ^ mask)
        got = yield Step(rnd, sends=((partner, acc),), recvs=(partner,))
        theirs = got[partner]
        # lower block on the left: every rank combines in the same order
        acc = combine(theirs, acc) if (newrank ^ mask) < newrank else combine(acc, theirs)
        if type(acc) is Failed:
            lo = newrank & ~(2 * mask - 1)  # (the two blocks: lo.. and lo + mask..)
            acc = acc.at(_real(range(lo, lo + mask), rem), _real(range(lo + mask, lo + 2 * mask), rem))
        mask <<= 1
        rnd += 1
    if r < 2 * rem:
        yield Step(_ceil_log2(p) + 1, sends=((r - 1, acc),))
    return acc


def _real(newranks: range, rem: int) -> list[int]:
    """The ranks whose operands the partial results of recursive doubling's ``newranks``
    hold (each of the first ``rem`` holds its even neighbour's too)."""
    out: list[int] = []
    for nr in newranks:
        out += (2 * nr, 2 * nr + 1) if nr < rem else (nr + rem,)
    return out


def all_gather_flat(ctx: Ctx, obj: Any) -> Plan:
    n, r = ctx.size, ctx.rank
    if n == 1:
        return [obj]
    peers = _others(n, r)
    got = yield Step(0, sends=_to(peers, obj), recvs=peers)
    got[r] = obj
    return [got[i] for i in range(n)]


def all_gather_bruck(ctx: Ctx, obj: Any) -> Plan:
    n, r = ctx.size, ctx.rank
    blocks = [obj]  # blocks[i] belongs to rank (r + i) % n
    k = 0
    while len(blocks) < n:
        d = 1 << k
        count = min(d, n - d)
        dst, src = (r - d) % n, (r + d) % n
        got = yield Step(k, sends=((dst, blocks[:count]),), recvs=(src,))
        blocks.extend(got[src])
        k += 1
    return [blocks[(i - r) % n] for i in range(n)]


def all_to_all(ctx: Ctx, objs: Sequence[Any]) -> Plan:
    n, r = ctx.size, ctx.rank
    if n == 1:
        return [objs[0]]
    peers = _others(n, r)
    got = yield Step(0, sends=tuple((p, objs[p]) for p in peers), recvs=peers)
    got[r] = objs[r]
    return [got[i] for i in range(n)]


# ------------------------------------------------------------------ one- and two-hop variants
#
# Depth 1 or 2 instead of log2(N): every non-root rank is woken once per call. They win where
# waking a process is what costs (small worlds, more ranks than cores); the leader handles
# N-1 messages, so above a measured world size the log-depth algorithms take over.


# Both directions of a star use one round, STAR: rank 0 receives (STAR, p) from each p != 0
# and every other rank receives (STAR, 0), so they cannot be confused, and a non-root rank
# sends and receives in one step (one trip through the plan instead of two). No other plan
# uses that round: ranks that chose different algorithms (CTRLCOMM_ALGO set unlike on
# different ranks) never take each other's messages for their own; they time out instead of
# computing a wrong result.
STAR = 64


def barrier_star(ctx: Ctx) -> Plan:
    """All to rank 0, then rank 0 to all (an all_reduce of nothing, written out: a barrier
    is the call made most often)."""
    n, r = ctx.size, ctx.rank
    if r:
        yield Step(STAR, ((0, None),), (0,))
        return None
    if n > 1:
        yield Step(STAR, recvs=tuple(range(1, n)))
        yield Step(STAR, sends=_to(range(1, n), None))
    return None


def all_reduce_star(ctx: Ctx, obj: Any, combine: Callable[[Any, Any], Any]) -> Plan:
    """Everyone sends to rank 0, which combines in rank order and sends the result back."""
    n, r = ctx.size, ctx.rank
    if r:
        got = yield Step(STAR, ((0, obj),), (0,))
        return got[0]
    if n == 1:
        return obj
    got = yield Step(STAR, recvs=tuple(range(1, n)))
    got[0] = obj
    acc = fold(combine, list(map(got.__getitem__, range(n))))
    yield Step(STAR, sends=_to(range(1, n), acc))
    return acc


def all_gather_star(ctx: Ctx, obj: Any) -> Plan:
    n, r = ctx.size, ctx.rank
    if r:
        got = yield Step(STAR, ((0, obj),), (0,))
        out = got[0]
        if type(out) is list and len(out) == n:  # (else a failure sent in its place)
            out[r] = obj  # its own slot: the object it passed, not the copy that came back
        return out
    if n == 1:
        return [obj]
    got = yield Step(STAR, recvs=tuple(range(1, n)))
    got[0] = obj
    out = list(map(got.__getitem__, range(n)))
    yield Step(STAR, sends=_to(range(1, n), out))
    return out


def broadcast_flat(ctx: Ctx, obj: Any, root: int) -> Plan:
    if ctx.rank == root:
        yield Step(0, sends=_to(_others(ctx.size, root), obj))
        return obj
    got = yield Step(0, recvs=(root,))
    return got[root]


def gather_flat(ctx: Ctx, obj: Any, root: int) -> Plan:
    if ctx.rank != root:
        yield Step(0, sends=((root, obj),))
        return None
    others = _others(ctx.size, root)
    got = (yield Step(0, recvs=others)) if others else {}
    got[root] = obj
    return [got[i] for i in range(ctx.size)]


def scatter_flat(ctx: Ctx, objs: Sequence[Any] | None, root: int) -> Plan:
    if ctx.rank == root:
        assert objs is not None
        yield Step(0, sends=tuple((p, objs[p]) for p in _others(ctx.size, root)))
        return objs[root]
    got = yield Step(0, recvs=(root,))
    return got[root]


def reduce_flat(ctx: Ctx, obj: Any, combine: Callable[[Any, Any], Any], root: int,
                ordered: bool = True) -> Plan:
    # (the root folds every rank's part in rank order: ``ordered`` or not)
    got = yield from gather_flat(ctx, obj, root)
    if got is None:
        return None
    return fold(combine, got)
