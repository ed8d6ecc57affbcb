"""The formation protocol: how the ranks of a group meet through a store.

Each rank sets its key (``rank/<r>``: its address record, :class:`ctrlcomm._wire.AddressRecord`)
with ``set_if_absent`` (a second process of a rank is refused: the key is taken); rank 0 waits
for every rank's key, compares the settings every rank must have alike, draws the group's
nonce and secret, hands each rank its secret (a key only that rank's client may read) and
publishes the address table; each rank reads the table and its secret and acknowledges; the
last acknowledgement settles the formation, and the keys are deleted. A rank that gives up
leaves a mark, so that the others name it as gone rather than never come; a formation that
times out says which ranks did not join, as far as the store can tell.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from typing import Any

from .. import _wire as w
from .._errors import (
    FormationError,
    FormationStoreTimeoutError,
    FormationTimeoutError,
    InvalidArgumentError,
    StoreError,
    StoreTimeoutError,
    WireError,
)
from .._patience import Watch, note, until_due
from ..transport._net import (
    _tcp,
    _wildcard,
    proc_address,
    proc_runs,
    resolve,
    same_host_procs,
)
from ._client import StoreClient, _check_host


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


def _record(address: str) -> w.AddressRecord | None:
    """The record of an address line another rank published (None: not one)."""
    try:
        return w.decode_address(address)
    except WireError:
        return None


def _joined_from(address: bytes) -> str:
    """Where the process of an address line (another's, of this rank) joined from, in words:
    its endpoint, and its pid where it runs on this host (its line's ``proc:`` field)."""
    rec = _record(address.decode(errors="replace"))
    if rec is None:
        return "from an unknown address"
    where = f"from {rec.endpoint}"
    proc = next(iter(rec.named("proc")), "").split(":")
    mine = proc_address().split(":")
    if len(proc) == 4 and len(mine) == 4:
        if proc[1] == mine[1]:
            return f"{where} by process {proc[2]} of this host"
        return f"{where} by a process of another host (or PID namespace)"
    return where


def _token(address: str) -> str:
    """The "join:" field of an address line: its try's own ("" from a release without)."""
    rec = _record(address)
    return next(iter(rec.named("join")), "") if rec is not None else ""


def _not_joined(missing: list[int], gave_up: list[int]) -> str:
    """Which ranks are not in, in words (of :func:`_missing_ranks`)."""
    parts = [f"ranks {missing} did not join"] if missing else []
    if gave_up:
        parts.append(f"ranks {gave_up} joined and gave up before (at their own deadline, "
                     "or on an error)")
    return "; ".join(parts)


_ALIKE_WORDS = {"ws": "world size", "codec": "codec", "tr": "transport", "wire": "wire version"}
ASK_S = 0.5  # how long a formation that timed out asks the store why
SETTLE_S = 2.0  # how long rank 0 waits for the others to read that the group is formed
# how often rank 0, waiting for ranks, compares the settings of those in (and a rank waiting
# for rank 0 looks whether the group formed without it: FORMED)
DIFFER_CHECK_S = 0.5
# A rank waiting for the address table looks which ranks have not joined this long before
# the warning a long wait logs says it (_patience)
TABLE_LOOK_S = 0.5
# Where, in a group's namespace of the store, formation keeps its keys (deleted once the group
# is formed): apart from the keys the ranks set through the group's store client (Group.store)
FORMATION = "ctrlcomm:formation/"
# The mark a rank leaves where it withdraws its key (_withdraw), so that the others, timing out
# at their own deadlines moments later, name it as gone, not as never come. It holds the token
# of rank 0's address line it knew: only a mark of the try a rank is in counts (one of an
# earlier try of this name, never deleted where that try failed, does not).
GAVE_UP = f"{FORMATION}gave-up/"
# Where rank 0 could not bind its store's port, and a store of ours holds it that takes its
# word (another group's), it leaves why here, "EXPIRY|why" (EXPIRY: its deadline, wall
# clock): the ranks that wait for it read it, and fail at once with its error, not at their
# deadlines with none (tell_bind_failure, _rank0)
# (Not under FORMATION: the store lets only the ranks that joined a formation touch its keys.)
RANK0_FAILED = "ctrlcomm:rank0-failed"
# The table of the group formed under a name, kept by its rank 0 until it closes the group: a
# rank that comes after formation (a restarted process, or a duplicate) reads there at once
# that the group formed without it, and which process holds its rank, instead of waiting out
# its deadline for ranks that will never come. (Not under FORMATION: a prefix deleted there
# by a failed try must not take it.)
FORMED = "ctrlcomm:formed"


def _proc_gone(line: str) -> bool:
    """Whether the process that published address ``line`` is this one, or one of this host
    that no longer runs (a stale FORMED table: its rank 0 died without closing, with the
    store elsewhere). A process of another host is taken to run."""
    rec = _record(line)
    proc = next(iter(rec.named("proc")), "") if rec is not None else ""
    mine = proc_address()
    if proc and proc == mine:
        return True
    here = same_host_procs({0: proc}, mine)
    return bool(here) and not proc_runs(*here[0])


def _formed_without(store: StoreClient, rank: int, name: str, deadline: float,
                    mine: str = "") -> None:
    """Raise FormationError where group ``name`` formed already without this process (its
    FORMED table holds rank ``rank``, published by a process that runs and is not this one;
    ``mine``: this try's own line, which a table of its own formation holds)."""
    try:
        text = store.get(FORMED, wait=False, timeout=min(_left(deadline), ASK_S)).decode()
    except (KeyError, StoreError):
        return
    lines = text.split("\n")
    if len(lines) < 2 or rank + 1 >= len(lines) or lines[rank + 1] == mine:
        return
    holder = lines[rank + 1]
    if _proc_gone(holder) or _proc_gone(lines[1]):
        return
    raise FormationError(
        f"group {name!r} formed without this process: it has {len(lines) - 1} ranks, and "
        f"rank {rank} joined {_joined_from(holder.encode())} (a restarted or duplicate "
        "process: give the group another name, or have its members admit new processes "
        "with Group.grow and Group.join)")


def _alike(address: str) -> dict[str, str]:
    rec = _record(address)
    return {} if rec is None else rec.alike()


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
                deadline: float, rank0_hosts: bool = True, late_check: bool = True
                ) -> tuple[str, str, dict[int, str]]:
    """:func:`_rendezvous_now`, telling what it waits for once it has waited long (a warning
    through logging, see ``_patience``: "formation of 'ctrl', rank 0: 30 s of 300 s, waiting
    for ranks [3] to join")."""
    where = f"the store at {getattr(store, 'host', '?')}:{getattr(store, 'port', '?')}"
    with Watch(f"formation of {name!r}, rank {rank}", deadline - time.monotonic(),
               f"{where} to answer" + (" (rank 0 hosts it: is rank 0 up?)" if rank0_hosts
                                       else "")):
        return _rendezvous_now(store, address, rank, size, name, deadline, rank0_hosts,
                               late_check)


def _rendezvous_now(store: StoreClient, address: str, rank: int, size: int, name: str,
                    deadline: float, rank0_hosts: bool = True, late_check: bool = True
                    ) -> tuple[str, str, dict[int, str]]:
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
    ``late_check``: whether to look for a group of this name formed already (FORMED), as
    a new group's ranks do (not those of a group that grows: it is formed under its name).
    """
    if late_check:
        try:
            _formed_without(store, rank, name, deadline)
        except StoreTimeoutError as e:
            if e.answered:
                raise
            raise _silent_store(store, name, rank, rank0_hosts) from None
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
    note(f"ranks {list(range(1, size))} to join" if rank == 0 else "rank 0 to join")
    try:
        return _join(store, address, rank, size, name, deadline, done, rank0_hosts,
                     late_check)
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
                    deadline: float, done: dict[str, str], late_check: bool) -> None:
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
        if late_check:
            _formed_without(store, 0, name, deadline, address)
        try:
            have = store.exists(keys[1:], timeout=ASK_S)
            joined = [k for k, h in zip(keys[1:], have, strict=True) if h]
            note(f"ranks {[r for r, h in enumerate(have, 1) if not h]} to join")
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
          deadline: float, done: dict[str, str], rank0_hosts: bool = True,
          late_check: bool = True) -> tuple[str, str, dict[int, str]]:
    """:func:`_rendezvous` once this rank's key is set; ``done``: see there."""
    keys = [f"{FORMATION}rank/{r}" for r in range(size)]
    if rank == 0:
        return _lead(store, keys, address, name, deadline, done, rank0_hosts, late_check)
    return _follow(store, keys, address, rank, name, deadline, done, rank0_hosts, late_check)


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)


def _lead(store: StoreClient, keys: list[str], address: str, name: str, deadline: float,
          done: dict[str, str], rank0_hosts: bool, late_check: bool
          ) -> tuple[str, str, dict[int, str]]:
    """Rank 0's part of :func:`_join`: wait for the ranks, publish the table and the
    secrets, wait for the formation to settle."""
    size = len(keys)
    try:
        _wait_for_ranks(store, keys, name, address, deadline, done, late_check)
    except StoreTimeoutError as e:
        raise _ranks_missing(store, keys, e, name, address, done) from None
    addrs = [a.decode() for a in store.multi_get(keys, timeout=_left(deadline))]
    differ = _differ(name, address, dict(enumerate(addrs)))
    if differ:
        done["differ"] = ""
        store.set(f"{FORMATION}table", "!" + differ, timeout=_left(deadline))
        raise FormationError(differ)
    nonce, secret = os.urandom(8).hex(), os.urandom(32).hex()
    done["table"] = ""
    if size > 1:
        store.multi_set([f"{FORMATION}secret/{r}" for r in range(1, size)], [secret] * (size - 1),
                        timeout=_left(deadline))
    store.set(f"{FORMATION}table", "\n".join([nonce, *addrs]), timeout=_left(deadline))
    if size > 1:
        note("every rank to read the address table")
        _settled(store, nonce, 0, size, name, deadline, rank0_hosts=rank0_hosts)
    # this formation's keys only: the ranks may have set keys of their own already,
    # through the group's store client, since they read the table; and, having closed
    # the group at once, one may be in the next formation of this name already (a
    # prefix deleted would take its key). Each other rank deleted its own key (and
    # the last to read the settlement its counters: _settled).
    table = "\n".join([nonce, *addrs])
    try:  # (best effort: formed; rank 0's wait in _settled may have reached the deadline)
        store.set(FORMED, table, timeout=ASK_S)
        store.multi_delete([keys[0], f"{FORMATION}table", RANK0_FAILED,
                            *(f"{GAVE_UP}{r}" for r in range(size)),
                            *(f"{FORMATION}secret/{r}" for r in range(1, size))],
                           timeout=ASK_S)
    except StoreError:
        pass
    return nonce, secret, dict(enumerate(addrs))


def _ranks_missing(store: StoreClient, keys: list[str], e: StoreTimeoutError, name: str,
                   address: str, done: dict[str, str]) -> FormationTimeoutError:
    """What rank 0 raises where ranks did not join in time: which, as the store tells."""
    size = len(keys)
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
    return FormationTimeoutError(
        f"group {name!r} not formed within the timeout: "
        + (_not_joined(missing, gave_up) or "the store could not tell which ranks "
           "did not join") + (f" ({differ})" if differ else ""),
        missing=missing, gave_up=gave_up)


def _follow(store: StoreClient, keys: list[str], address: str, rank: int, name: str,
            deadline: float, done: dict[str, str], rank0_hosts: bool, late_check: bool
            ) -> tuple[str, str, dict[int, str]]:
    """The part of :func:`_join` of a rank other than 0: read rank 0's settings, then the
    table and this rank's secret, and acknowledge."""
    size = len(keys)
    # rank 0's settings, as soon as it has joined: a rank created otherwise says so at once
    # (rank 0, waiting for ranks that never come, says it at its deadline)
    try:
        first = _rank0(store, keys[0], rank, name, deadline, late_check)
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
    note("rank 0's address table (published once every rank has joined)")
    lines = _table(store, address, rank, size, name, deadline, done, rank0_hosts)
    note("every rank to read the address table")
    nonce = lines[0]
    try:  # (set before the table was: there, unless the table is another try's)
        secret = store.get(f"{FORMATION}secret/{rank}", wait=False,
                           timeout=_left(deadline)).decode()
        store.delete(f"{FORMATION}secret/{rank}", timeout=min(_left(deadline), ASK_S))
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
        store.delete(keys[rank], timeout=min(_left(deadline), ASK_S))
    except StoreError:
        pass
    known = None
    if store.add(f"{FORMATION}acks/{nonce}", 1, timeout=_left(deadline)) == size - 1:
        # the last to read it: the group is formed, unless a rank whose wait ran out
        # settled it first (as failed)
        ok, held = store.set_if_absent(f"{FORMATION}done/{nonce}", "1", timeout=_left(deadline))
        known = b"1" if ok else held
    _settled(store, nonce, rank, size, name, deadline, known, rank0_hosts)
    return nonce, secret, dict(enumerate(lines[1:]))


def _rank0(store: StoreClient, key: str, rank: int, name: str, deadline: float,
           late_check: bool) -> str:
    """Rank 0's address line, waited for until ``deadline``; every DIFFER_CHECK_S
    meanwhile (``late_check``), a look whether the group formed without this process."""
    while True:
        left = _left(deadline)
        try:
            return store.get(key, timeout=min(left, DIFFER_CHECK_S) if late_check
                             else left).decode()
        except StoreTimeoutError as e:
            if not late_check or not e.answered or left <= DIFFER_CHECK_S:
                raise
        _formed_without(store, rank, name, deadline)
        _rank0_failed(store, rank, name)


def tell_bind_failure(store: StoreClient, why: str, deadline: float) -> None:
    """(Rank 0, whose store could not bind its port, held by ``store``.) Leave ``why`` for the
    ranks that wait for rank 0 there, until ``deadline``; best effort."""
    expiry = time.time() + max(deadline - time.monotonic(), 0.0)
    try:
        store.set(RANK0_FAILED, f"{expiry:.3f}|{why}", timeout=ASK_S)
    except (StoreError, OSError):
        pass


def _rank0_failed(store: StoreClient, rank: int, name: str) -> None:
    """Raise rank 0's error where it could not bind its store (see RANK0_FAILED)."""
    try:
        text = store.get(RANK0_FAILED, wait=False, timeout=ASK_S).decode(errors="replace")
    except (KeyError, StoreError):
        return
    expiry, _, why = text.partition("|")
    try:
        if float(expiry) < time.time():
            return  # (an earlier try's)
    except ValueError:
        return
    raise FormationError(f"group {name!r} not formed on rank {rank}: rank 0 failed: {why} "
                         "(this rank reached another program's store on that port)")


def _table(store: StoreClient, address: str, rank: int, size: int, name: str,
           deadline: float, done: dict[str, str], rank0_hosts: bool) -> list[str]:
    """The lines of the address table rank 0 published for this try (its nonce first)."""
    noted = False  # (which ranks rank 0 waits for: looked up just before a warning says it)
    while True:
        left = _left(deadline)
        due = until_due()
        look = due + 0.05 if noted else max(due - TABLE_LOOK_S, 0.05)
        try:
            text = store.get(f"{FORMATION}table", timeout=min(left, look)).decode()
        except StoreTimeoutError as e:
            if e.answered and left > look:
                noted = noted and until_due() <= TABLE_LOOK_S
                if not noted and until_due() <= TABLE_LOOK_S:
                    _note_missing(store, size, done["rank0"])
                    noted = True
                continue
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
            return lines
        if time.monotonic() >= deadline:  # a stale table, of an earlier try or group
            raise FormationTimeoutError(
                f"group {name!r} not formed within the timeout on rank {rank}: the address "
                "table in the store does not hold this rank's address (rank 0 published it "
                "for an earlier try of this rank, or for an earlier group of this name): "
                "try again")
        time.sleep(0.05)


def _note_missing(store: StoreClient, size: int, token: str) -> None:
    """(A rank that waits for the address table.) Which ranks are not in, as the store tells
    (:func:`_missing_ranks`; ``token``: rank 0's), noted for the warning a long wait logs."""
    missing = sorted(sum(_missing_ranks(store, range(size), ASK_S, token), []))
    note(f"ranks {missing} to join (rank 0 publishes the address table then)" if missing
         else "rank 0's address table")


def _settled(store: StoreClient, nonce: str, rank: int, size: int, name: str,
             deadline: float, known: bytes | None = None, rank0_hosts: bool = True) -> None:
    """Wait until the formation of table ``nonce`` is settled, and raise
    FormationTimeoutError where it failed. Every rank reads the one value its store holds,
    set once (``set_if_absent``): "1" by the last rank to read the table (formed), or
    "!rank|why" by the first rank whose wait ran out (failed; why names the ranks that had
    not read the table, where the store can tell: they joined, so they are not
    ``missing``). So no rank's group is formed where another's is not (else a rank that had
    read the table would return a group while rank 0 failed, waiting for a rank that had
    died after joining, and its first call would blame rank 0, "stopped answering
    heartbeats", not the rank that had died). ``known``: the value, where this rank set
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
