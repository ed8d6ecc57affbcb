"""Making a group's core: its parts (endpoint, heartbeat), its address record, the core from
an address table; and the groups made from a group without a store.

``split``/``new_group`` run as one all_gather of the parent's (each rank's color, key and the
address record of its new endpoint), after which the members of each color make their core
from the records of that color: no store, no connection but the new group's own. ``shrink``
runs on a broken group too, over the connections still up: the survivors swap address records
and then agree on who is in with the hierarchical consensus of Cachin, Guerraoui and
Rodrigues ("Introduction to Reliable and Secure Distributed Programming", algorithm 5.2):
in round ``i``, rank ``i`` sends the proposal it holds to the ranks above it, and each of
them takes it, or goes on where rank ``i`` is known gone. Every survivor ends with the
proposal of the lowest survivor, even where ranks fail during it, as long as a rank
known gone is gone (a connection's end, a process seen to exit, or heartbeats silent past
``liveness_timeout``: a rank hung longer than that is left out).
"""

from __future__ import annotations

import hashlib
import operator
import os
import time
from typing import Any, NamedTuple

from . import _wire as w
from ._calls import RESERVED_TAGS
from ._core import Core, Wait
from ._endpoint import Endpoint
from ._errors import FormationError, GroupBrokenError, InvalidArgumentError, PeerLostError, WireError, show
from .rendezvous._formation import _group_id, _group_key, _host_of, _reachable
from .transport import make_endpoint
from .transport._heartbeat import Heartbeat
from .transport._net import _parse_tcp, _tcp, _wildcard, local_address_for, proc_address, same_host_procs

CODECS = {"pickle": w.PICKLE, "msgpack": w.MSGPACK}
RECORDS_TAG, AGREE_TAG = sorted(RESERVED_TAGS)  # (a shrink's two kinds of message)


class _Setup(NamedTuple):
    """What a group was made with that the groups made from it (split, shrink, grow) are made
    with too."""

    store_host: str  # (as given)
    store_address: str  # (looked up)
    port: int
    bind_host: str
    codec: str
    transport: str
    key: bytes | None
    encrypt: bool
    zmq_context: Any
    beat: float
    live: float | None
    spin: float
    timeout: float
    external: Any = None  # (the store given as Group.create's store=, if one was)


def _new_parts(s: _Setup, rank: int) -> tuple[Endpoint, Heartbeat]:
    """A new endpoint and heartbeat for a group made with ``s``."""
    ep = make_endpoint(s.transport, s.bind_host, zmq_context=s.zmq_context, encrypt=s.encrypt,
                       spin_us=s.spin * 1e6)
    try:
        return ep, Heartbeat(s.bind_host, 0, rank, None, s.beat)
    except BaseException:
        ep.close()
        raise


def _make_core(s: _Setup, ep: Endpoint, hb: Heartbeat, rank: int, size: int, name: str,
               nonce: str, secret: str, table: dict[int, str]) -> Core:
    """The core of group ``name`` whose ranks published ``table`` (their address records),
    formed with ``nonce`` and ``secret``: peers set, MAC key derived, heartbeats started."""
    try:
        records = {r: w.decode_address(line) for r, line in table.items()}
    except WireError as e:  # (rank 0 published what a rank of this version did not make)
        raise FormationError(f"group {name!r}: {e}") from None
    peers = {r: _reachable(a.endpoint, s.store_address) for r, a in records.items()}
    try:
        ep.set_peers(peers, {r: list(a.fields) for r, a in records.items()})
    except FormationError as e:
        raise FormationError(f"group {name!r}: {e}") from None
    gid = _group_id(name, nonce)
    mac_key = _group_key(secret, gid, s.key)
    hb.group_id, hb.key, hb.rank = gid, mac_key, rank
    procs = {r: p[0] for r, a in records.items() if (p := a.named("proc"))}
    here = same_host_procs(procs, proc_address())
    hb.start({r: (_host_of(peers[r]), a.udp_port) for r, a in records.items() if r != rank},
             here)
    core = Core(name=name, rank=rank, size=size, group_id=gid, endpoint=ep,
                codec=CODECS[s.codec], key=mac_key, timeout=s.timeout, heartbeat=hb,
                liveness_timeout=s.live)
    ep.watch(here)  # (once the core takes what it tells)
    return core


def _address_record(ep: Endpoint, hb: Heartbeat, s: _Setup, world_size: int) -> str:
    """This rank's line of the address table (see w.AddressRecord)."""
    address = ep.address
    if _wildcard(s.bind_host):
        # bound to every interface: peers are told the one that reaches the store
        # (the address bound, 0.0.0.0, would send a peer elsewhere to its own host),
        # or, where the store is on every interface too, "*" (see Group.create)
        address = _tcp("*" if _wildcard(s.store_address)
                       else local_address_for(s.store_address, s.port),
                       _parse_tcp(address)[1][1])
    # what every rank must have alike, compared by rank 0 (a rank created with another world
    # size, codec or transport would wait, or fail, without saying why), and the wire
    # format's version: a peer of another reads none of its messages; "join:": this try's
    # own, so that no later try reads this one's table as its own, were its ports the same
    # again; "proc:" where this host has /proc (a silent peer of this host is looked up
    # there: see Heartbeat.running)
    fields = (*ep.published(), proc_address(), f"ws:{world_size}", f"codec:{s.codec}",
              f"tr:{s.transport}", f"wire:{w.VERSION}", "join:" + os.urandom(6).hex())
    return w.AddressRecord(address, hb.port, tuple(f for f in fields if f)).encode()


def _child_secret(parent_key: bytes, nonce: str) -> str:
    """The secret of a group made from a group whose MAC key is ``parent_key``: its members
    derive it, so nothing secret travels (the parent's ranks that are not members could
    derive it too: they are trusted as members of the parent)."""
    return hashlib.blake2b(nonce.encode(), key=parent_key[:64], digest_size=32,
                           person=b"ctrlcomm-child").hexdigest()


def check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not name or "/" in name or "\n" in name:
        raise InvalidArgumentError(f"{what}: group name must be a non-empty str without '/' or "
                                   f"newlines, got {show(name)}")
    return name


class Made(NamedTuple):
    """A group's core made from a parent group's: its ranks' numbers in the parent."""

    core: Core
    parent_ranks: list[int]


class Parts:
    """The endpoint and heartbeat a rank makes for a group it will be in, and its address
    record, made before the others know it: closed where the group is not made."""

    def __init__(self, setup: _Setup, size: int) -> None:
        self.ep, self.hb = _new_parts(setup, 0)
        try:
            self.line = _address_record(self.ep, self.hb, setup, size)
        except BaseException:
            self.close()
            raise

    def make(self, setup: _Setup, rank: int, name: str, nonce: str, secret: str,
             table: dict[int, str]) -> Core:
        core = _make_core(setup, self.ep, self.hb, rank, len(table), name, nonce, secret,
                          table)
        self.ep = self.hb = None  # type: ignore[assignment]  # (the core's now)
        return core

    def close(self) -> None:
        if self.hb is not None:
            self.hb.close()
        if self.ep is not None:
            self.ep.close()


# ------------------------------------------------------------------------ split, new_group


class Split(NamedTuple):
    """A split begun on this rank: what it gives the parent's all_gather, and its parts."""

    item: list[Any]  # [color, key, address record, name, ranks (new_group's) or None]
    parts: Parts | None

    def close(self) -> None:
        if self.parts is not None:
            self.parts.close()


def _int(x: Any, what: str) -> int:
    try:
        return operator.index(x)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be an int, got {show(x)}") from None


def split_begin(core: Core, setup: _Setup, color: Any, key: Any, name: Any,
                ranks: Any = None) -> Split:
    """Check a split's arguments (``ranks``: new_group's, which it is then) and make this
    rank's parts where it is in a new group."""
    what = "new_group" if ranks is not None else "split"
    if ranks is not None:
        if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
            raise InvalidArgumentError(f"new_group: ranks must be a sequence of ranks, got "
                                       f"{show(ranks)}")
        rs = sorted(_int(r, "new_group: each rank") for r in ranks)
        bad = [r for r in rs if not 0 <= r < core.size]
        if bad or not rs or len(set(rs)) != len(rs):
            raise InvalidArgumentError(
                f"new_group on rank {core.rank}: ranks must be distinct ranks of the group "
                f"(0..{core.size - 1}), at least one, got {show(ranks)}")
        color, key = (0 if core.rank in rs else None), core.rank
        default = f"{core.name}.new_group"
    else:
        rs = None
        if color is not None:
            color = _int(color, f"split on rank {core.rank}: color")
        key = _int(key, f"split on rank {core.rank}: key")
        default = f"{core.name}.{color}"
    name = check_name(default if name is None else name, f"{what} on rank {core.rank}")
    parts = Parts(setup, core.size) if color is not None else None
    return Split([color, key, parts.line if parts else "", name, rs], parts)


def split_end(sp: Split, core: Core, setup: _Setup, got: list[Any], what: str
              ) -> Made | None:
    """The new group of this rank, from what every rank gave the parent's all_gather, or
    None where this rank's color is None."""
    color, _, _, name, ranks = sp.item
    try:
        items = [list(it) for it in got]
        if any(len(it) != 5 for it in items):
            raise ValueError
    except (TypeError, ValueError):
        raise FormationError(f"{what} on group {core.name!r}: a rank gave the all_gather "
                             "what a split does not") from None
    if any(it[4] != ranks for it in items):
        lists = {r: it[4] for r, it in enumerate(items)}
        raise InvalidArgumentError(f"{what} on group {core.name!r}: the ranks gave different "
                                   f"ranks: {lists}")
    if color is None:
        return None
    members = sorted((r for r, it in enumerate(items) if it[0] == color),
                     key=lambda r: (items[r][1], r))
    names = sorted({items[r][3] for r in members})
    if len(names) > 1:
        raise InvalidArgumentError(f"{what} on group {core.name!r}: the ranks of color {color} "
                                   f"gave different names: {names}")
    table = {i: str(items[r][2]) for i, r in enumerate(members)}
    # (from what every member has alike: the members' records, each with its own random
    # join token, so a nonce of this split only)
    nonce = hashlib.blake2b("\n".join([str(core.group_id), *table.values()]).encode(),
                            digest_size=8).hexdigest()
    assert sp.parts is not None
    made = sp.parts.make(setup, members.index(core.rank), name, nonce,
                         _child_secret(core.key, nonce), table)
    return Made(made, members)


# ---------------------------------------------------------------------------------- shrink


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)


def _take(core: Core, src: int, tag: int, attempt: int, deadline: float, name: str
          ) -> Wait:
    """(shrink) The next message of ``src`` with ``tag`` of this attempt (one of an earlier
    shrink of this group, which failed, is passed over)."""
    while True:
        m = yield from core.recv(src, tag, _left(deadline), name, broken_ok=True)
        if isinstance(m, (list, tuple)) and m and isinstance(m[0], int):
            if m[0] >= attempt:
                return list(m)
            continue
        raise FormationError(f"{name} on group {core.name!r}: rank {src} sent what a shrink "
                             "does not")


def _send(core: Core, obj: Any, dst: int, tag: int, deadline: float, name: str) -> Wait:
    try:
        yield from core.send(obj, dst, tag, _left(deadline), name, broken_ok=True)
    except PeerLostError:
        pass  # (a rank lost: the others go on without it)


def shrink_plan(core: Core, setup: _Setup, parts: Parts, attempt: int,
                timeout: float | None) -> Wait:
    """(Run by a driver on the parent's core.) The survivors' new group: see the module's
    docstring. Returns :class:`Made`."""
    t = core.timeout if timeout is None else timeout
    deadline = time.monotonic() + t
    me, n, name = core.rank, core.size, "shrink"
    # gone means seen gone here (its connection's end, its process's exit, its heartbeats'
    # silence, its goodbye): a rank that aborted, or that another rank reported lost, may
    # be alive and in this shrink, and is waited for until it is seen gone itself (else a
    # slow rank that the others' timeouts aborted would shrink to a group of its own)
    core.forget_hearsay()
    # every survivor's address record, from each rank not known gone
    for d in range(n):
        if d != me and d not in core.gone:
            yield from _send(core, [attempt, parts.line], d, RECORDS_TAG, deadline, name)
    view = {me: parts.line}
    for s in range(n):
        if s != me and s not in core.gone:
            try:
                m = yield from _take(core, s, RECORDS_TAG, attempt, deadline, name)
            except PeerLostError:
                continue
            view[s] = str(m[1])
    # the agreement: the proposal of the lowest rank that sent one, passed up
    proposal: list[Any] = [attempt, me, os.urandom(8).hex(), sorted(view.items())]
    for i in range(me):
        # (asked even where rank i is known gone: it may have sent its proposal before it
        # went, or closed the parent once its shrink returned, and what came is taken first)
        try:
            proposal = yield from _take(core, i, AGREE_TAG, attempt, deadline, name)
        except PeerLostError:
            continue
    for d in range(me + 1, n):
        if d not in core.gone:
            yield from _send(core, proposal, d, AGREE_TAG, deadline, name)
    try:
        _, by, nonce, pairs = proposal
        table = {int(r): str(line) for r, line in pairs}
    except (TypeError, ValueError):
        raise FormationError(f"shrink on group {core.name!r}: rank {proposal[1]} proposed "
                             "what a shrink does not") from None
    members = sorted(table)
    if me not in table:
        raise GroupBrokenError(
            f"shrink of group {core.name!r}: rank {me} was left out: rank {by}, which chose "
            "the survivors, took it for lost")
    made = parts.make(setup, members.index(me), core.name, str(nonce),
                      _child_secret(core.key, str(nonce)),
                      {i: table[r] for i, r in enumerate(members)})
    return Made(made, members)
