"""The rendezvous store's state machine (pure), its access rules and its limits.

The store only forms groups (ranks publish their endpoints, rank 0 publishes the table); it is
never the data plane. :class:`StoreState` is the server's logic with no sockets and no clock of
its own (callers pass ``now``); :mod:`ctrlcomm.rendezvous._server` runs it on a socket in a thread.
Waiting requests (``get`` of missing keys, ``wait``) are parked until their keys exist or their
deadline passes; the reply then says which keys were missing.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from .. import _wire as w
from .._errors import (
    InvalidArgumentError,
    show,
)

MAX_KEY = 4096
MAX_VALUE = w.STORE_MAX_VALUE
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_KEY_LEN = struct.Struct("<I")  # each key of a list_keys reply: its length, then its bytes
_MiB = 1 << 20


@dataclass(frozen=True)
class StoreLimits:
    """What a store takes at most, so that no client (a stranger's, where the store has no
    key) can grow it without bound. Each default is far above what forming and running
    groups of 1,024 ranks asks of a store; a request past a limit is refused with a
    :class:`StoreError` that names it, and the store goes on serving.

    Attributes:
        max_value_bytes: the longest value (keys: at most 4096 bytes).
        max_total_bytes: keys, values and queued values held, and the keys of requests
            waiting, all together.
        max_keys: keys and queued values held.
        max_waiters: requests waiting for keys (a ``get`` or ``wait``) or a queued value.
        max_connections: open connections (a store without a key); at the limit, the
            least recently active one is closed for a new one (a client reconnects as it
            next asks, without losing its place).
        max_frames: frames of one request (a store without a key: a request of more ends
            its connection).
    """

    max_value_bytes: int = w.STORE_MAX_VALUE
    max_total_bytes: int = 32 * _MiB
    max_keys: int = 65_536
    max_waiters: int = 16_384
    max_connections: int = 4_096
    max_frames: int = w.MAX_STORE_KEYS + 8

    def __post_init__(self) -> None:
        for name in ("max_value_bytes", "max_total_bytes", "max_keys", "max_waiters",
                     "max_connections", "max_frames"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise InvalidArgumentError(f"StoreLimits: {name} must be an int >= 1, got "
                                           f"{show(v)}")
        if self.max_value_bytes > w.STORE_MAX_VALUE:
            raise InvalidArgumentError(f"StoreLimits: max_value_bytes is at most "
                                       f"{w.STORE_MAX_VALUE} (the wire's limit)")


# A group's formation keeps its keys under this mark in the group's namespace of the store
# (ctrlcomm._group.FORMATION): the store lets only the ranks that joined read or change them
# (StoreState._allowed).
FORMATION_MARK = b"ctrlcomm:formation/"
_RANK_KEY = b"rank/"
_SECRET_KEY = b"secret/"
_TABLE_KEY = b"table"


def _formation(key: bytes) -> tuple[bytes, bytes] | None:
    """``(namespace, rest)`` of a formation key (its namespace ending with the mark), else
    None."""
    i = key.find(FORMATION_MARK)
    if i < 0:
        return None
    j = i + len(FORMATION_MARK)
    return key[:j], key[j:]


@dataclass(slots=True)
class _Waiter:
    peer: bytes
    req: w.StoreRequest
    deadline: float
    size: int  # bytes it holds (its keys), counted in StoreState.held


class StoreState:
    """The store's data and parked waiters. ``handle`` returns the replies to send now.

    Who may read and change a group's formation keys: a client (``peer``) joins a
    formation by setting a rank's key (``rank/<r>``) where it is absent (``set_if_absent``);
    from then on it may read that formation's keys and change them, but for these:

    - ``rank/<r>``: changed and deleted by the client that set it only;
    - ``table`` (the address table): written and deleted by rank 0's client only;
    - ``secret/<r>`` (the secret the group's messages are authenticated with, for rank
      ``r``): read by rank ``r``'s client only, changed by rank 0's or rank ``r``'s.

    Anyone else is refused. (So a client that joins as a rank the group does not have
    learns no secret, and none can change the table the ranks connect by.) Once a
    formation's keys are all deleted, who had joined it is forgotten.
    """

    def __init__(self, limits: StoreLimits | None = None) -> None:
        self.limits = limits or StoreLimits()
        self.data: dict[bytes, bytes] = {}
        self.held = 0  # bytes of keys, values, queued values and parked requests' keys
        self.waiters: list[_Waiter] = []
        self.members: dict[bytes, set[bytes]] = {}  # formation namespace -> who joined it
        self.owners: dict[bytes, bytes] = {}  # a formation's rank key -> who set it
        self.formation_keys: dict[bytes, int] = {}  # formation namespace -> its keys held
        # queues (queue_push/pop/len), by name; ``queued``: their items, all queues together
        # (a pop of an empty one waits among ``waiters``: a push tells them all to pop again)
        self.queues: dict[bytes, deque[bytes]] = {}
        self.queued = 0
        self.requests = 0
        # Clients resend a request they got no answer to (same id). The last request of each
        # client and its reply (None while parked) make a resend safe: it is answered again,
        # never applied twice.
        self.recent: dict[bytes, tuple[int, w.StoreReply | None]] = {}

    def _missing(self, keys: Iterable[bytes]) -> list[bytes]:
        # (a queue that holds values counts, as in TCPStore: its wait() and check() see it)
        return [k for k in keys if k not in self.data and k not in self.queues]

    def _waited(self, req: w.StoreRequest) -> list[bytes]:
        """What a waiting request still waits for: a pop, its queue to hold a value (a key of
        that name does not count); a get or wait, its keys."""
        if req.op == w.S_QUEUE_POP:
            return [] if req.keys[0] in self.queues else list(req.keys)
        return self._missing(req.keys)

    def _park(self, peer: bytes, req: w.StoreRequest, now: float
              ) -> list[tuple[bytes, w.StoreReply]]:
        """A request that waits for what is not there yet: answered at once without a
        timeout, else when it comes (:meth:`_wake`) or at its deadline (:meth:`expire`)."""
        if req.timeout <= 0:
            return [(peer, w.StoreReply(w.R_TIMEOUT, req.req_id, tuple(self._waited(req))))]
        lim = self.limits
        # (a client asks one thing at a time: a request of its that still waits is one it
        # gave up on, or a resend after a reconnection took its place)
        self._unpark(peer)
        size = sum(len(k) for k in req.keys) + 64
        if len(self.waiters) >= lim.max_waiters:
            raise _Refused(f"too many requests waiting ({lim.max_waiters}, the store's "
                           "max_waiters)")
        if self.held + size > lim.max_total_bytes:
            raise _Refused(self._full(size))
        self.held += size
        self.waiters.append(_Waiter(peer, req, now + req.timeout, size))
        return []

    def _unpark(self, peer: bytes) -> None:
        if any(wt.peer == peer for wt in self.waiters):
            self.forget_peer(peer)

    def _full(self, more: int) -> str:
        return (f"the store is full: it holds {self.held} bytes, and {more} more would pass "
                f"its max_total_bytes ({self.limits.max_total_bytes})")

    def _answer(self, peer: bytes, req: w.StoreRequest) -> tuple[bytes, w.StoreReply]:
        if req.op == w.S_GET:
            # (b"" for a name that is a queue only, as TCPStore's get gives)
            return peer, w.StoreReply(w.R_OK, req.req_id,
                                      tuple(self.data.get(k, b"") for k in req.keys))
        return peer, w.StoreReply(w.R_OK, req.req_id)

    def handle(self, peer: bytes, req: w.StoreRequest, now: float) -> list[tuple[bytes, w.StoreReply]]:
        self.requests += 1
        prev = self.recent.get(peer)
        if prev is not None and prev[0] == req.req_id and prev[1] is not _NOT_KEPT:
            return [] if prev[1] is None else [(peer, prev[1])]
        try:
            out = self._handle(peer, req, now)
        except _Refused as e:
            out = [(peer, w.StoreReply(w.R_ERROR, req.req_id, (str(e).encode(),)))]
        except Exception as e:  # (not expected: answered, never the end of the server)
            out = [(peer, w.StoreReply(w.R_ERROR, req.req_id,
                                       (f"{type(e).__name__}: {e}"[:1000].encode(),)))]
        if len(self.recent) >= self.limits.max_connections and peer not in self.recent:
            self.recent.pop(next(iter(self.recent)))
        self.recent[peer] = (req.req_id, None)
        return self._remember(out)

    def _remember(self, out: list[tuple[bytes, w.StoreReply]]) -> list[tuple[bytes, w.StoreReply]]:
        for peer, rep in out:
            prev = self.recent.get(peer)
            if prev is not None and prev[0] == rep.req_id:
                # (a reply of more than KEEP_REPLY bytes is not kept: its request, resent,
                # runs again, as a get may; a pop of a large value whose reply was lost
                # takes the next one)
                kept = rep if sum(len(v) for v in rep.values) <= KEEP_REPLY else _NOT_KEPT
                self.recent[peer] = (rep.req_id, kept)
        return out

    # ------------------------------------------------------------ who may touch what

    def _allowed(self, peer: bytes, req: w.StoreRequest) -> None:
        """Refuse a request that touches a formation's keys where ``peer`` may not (see the
        class): ``_Refused`` names the key."""
        op = req.op
        if op in (w.S_PING, w.S_NUM_KEYS, w.S_LIST_KEYS, w.S_DELETE_PREFIX):
            return  # (list_keys and delete_prefix pass over the keys it may not touch)
        reads = op in _READS
        for k in req.keys:
            f = _formation(k)
            if f is None:
                continue
            ns, rest = f
            joining = op == w.S_CAS and rest.startswith(_RANK_KEY) and req.values[:1] == (b"1",)
            if not joining and peer not in self.members.get(ns, ()):
                raise _Refused(f"key {k[:200]!r} belongs to a group's formation, which this "
                               "client has not joined")
            if not joining and not self._may(peer, ns, rest, reads):
                raise _Refused(f"key {k[:200]!r} of a group's formation is not this "
                               "client's to " + ("read" if reads else "change"))

    def _may(self, peer: bytes, ns: bytes, rest: bytes, read: bool) -> bool:
        """Whether ``peer``, a member of formation ``ns``, may read (or change) its key
        ``rest`` (see the class)."""
        owners = self.owners
        if rest.startswith(_SECRET_KEY):
            mine = owners.get(ns + _RANK_KEY + rest[len(_SECRET_KEY):]) == peer
            rank0 = owners.get(ns + _RANK_KEY + b"0") == peer
            return mine if read else rank0 or mine
        if read:
            return True
        if rest.startswith(_RANK_KEY):
            return owners.get(ns + rest, peer) == peer
        if rest == _TABLE_KEY:
            return owners.get(ns + _RANK_KEY + b"0") == peer
        return True

    def _may_change(self, peer: bytes, key: bytes) -> bool:
        f = _formation(key)
        return f is None or (peer in self.members.get(f[0], ()) and
                             self._may(peer, f[0], f[1], False))

    def _may_see(self, peer: bytes, key: bytes) -> bool:
        f = _formation(key)
        return f is None or (peer in self.members.get(f[0], ()) and
                             self._may(peer, f[0], f[1], True))

    def _joined(self, peer: bytes, key: bytes) -> None:
        """``peer`` set the formation rank key ``key``: it joined that formation."""
        f = _formation(key)
        if f is not None and f[1].startswith(_RANK_KEY):
            self.members.setdefault(f[0], set()).add(peer)
            self.owners[key] = peer

    # ------------------------------------------------------------ the data, counted

    def _put(self, key: bytes, value: bytes) -> None:
        old = self.data.get(key)
        more = len(value) - len(old) if old is not None else len(key) + len(value)
        lim = self.limits
        if len(value) > lim.max_value_bytes:
            raise _Refused(f"a value of {len(value)} bytes is over the store's "
                           f"max_value_bytes ({lim.max_value_bytes})")
        if old is None and len(self.data) + self.queued >= lim.max_keys:
            raise _Refused(f"the store is full: it holds {lim.max_keys} keys and queued "
                           "values (its max_keys)")
        if more > 0 and self.held + more > lim.max_total_bytes:
            raise _Refused(self._full(more))
        self.data[key] = value
        self.held += more
        if old is None and (f := _formation(key)) is not None:
            self.formation_keys[f[0]] = self.formation_keys.get(f[0], 0) + 1

    def _delete(self, key: bytes) -> bool:
        value = self.data.pop(key, None)
        if value is None:
            return False
        self.held -= len(key) + len(value)
        f = _formation(key)
        if f is not None:
            self.owners.pop(key, None)
            n = self.formation_keys[f[0]] - 1
            if n:
                self.formation_keys[f[0]] = n
            else:  # (a formation's last key: who had joined it is forgotten)
                del self.formation_keys[f[0]]
                self.members.pop(f[0], None)
        return True

    def _handle(self, peer: bytes, req: w.StoreRequest, now: float) -> list[tuple[bytes, w.StoreReply]]:
        self._check_sizes(req)
        self._allowed(peer, req)
        op = req.op
        if op in (w.S_GET, w.S_WAIT):
            if not self._missing(req.keys):
                return [self._answer(peer, req)]
            return self._park(peer, req, now)
        if op in (w.S_QUEUE_PUSH, w.S_QUEUE_POP, w.S_QUEUE_LEN):
            return self._queue(peer, req, now)
        if op in (w.S_SET, w.S_ADD, w.S_CAS):
            return [(peer, self._write(peer, req))] + self._wake()
        return [(peer, w.StoreReply(w.R_OK, req.req_id, self._look(peer, req)))]

    def _check_sizes(self, req: w.StoreRequest) -> None:
        for k in req.keys:
            if len(k) > MAX_KEY:
                raise _Refused(f"key longer than {MAX_KEY} bytes")
        for v in req.values:
            if len(v) > self.limits.max_value_bytes:
                raise _Refused(f"a value of {len(v)} bytes is over the store's "
                               f"max_value_bytes ({self.limits.max_value_bytes})")

    def _look(self, peer: bytes, req: w.StoreRequest) -> tuple[bytes, ...]:
        """The values of an answer to a request that waits for nothing and sets no key."""
        op, keys = req.op, req.keys
        prefix = keys[0] if keys else b""
        if op == w.S_PING:
            return ()
        if op == w.S_NUM_KEYS:
            return (str(len(self.data)).encode(),)
        if op == w.S_LIST_KEYS:
            return (b"".join(_KEY_LEN.pack(len(k)) + k for k in self.data
                             if k.startswith(prefix) and self._may_see(peer, k)),)
        if op == w.S_CHECK:
            return tuple(b"0" if self._missing((k,)) else b"1" for k in keys)
        if op == w.S_DELETE:
            return (str(sum(1 for k in keys if self._delete(k))).encode(),)
        if op == w.S_DELETE_PREFIX:
            gone = [k for k in list(self.data)
                    if k.startswith(prefix) and self._may_change(peer, k) and self._delete(k)]
            return (str(len(gone)).encode(),)
        raise _Refused(f"unknown op {op}")  # pragma: no cover - decode_store_request checks

    def _write(self, peer: bytes, req: w.StoreRequest) -> w.StoreReply:
        """Set, add or compare-and-set one key; the reply."""
        keys, vals = req.keys, req.values
        if len(keys) != 1:
            raise _Refused("this request takes exactly one key")
        key = keys[0]
        if req.op == w.S_SET:
            if len(vals) != 1:
                raise _Refused("set takes one value")
            self._put(key, vals[0])
            return w.StoreReply(w.R_OK, req.req_id)
        if req.op == w.S_ADD:
            return w.StoreReply(w.R_OK, req.req_id, (self._add(key, vals),))
        if len(vals) != 3:
            raise _Refused("compare_set takes (expect_absent, expected, desired)")
        absent, expected, desired = vals[0] == b"1", vals[1], vals[2]
        held = self.data.get(key)
        if (held is None and (absent or expected == b"")) or (held is not None and not absent
                                                               and held == expected):
            self._put(key, desired)
            if held is None:
                self._joined(peer, key)
            return w.StoreReply(w.R_OK, req.req_id, (desired,))
        return w.StoreReply(w.R_CAS_FAIL, req.req_id, () if held is None else (held,))

    def _add(self, key: bytes, vals: tuple[bytes, ...]) -> bytes:
        try:
            delta = int(vals[0]) if len(vals) == 1 else None
            cur = int(self.data.get(key, b"0"))
        except ValueError:
            delta = None
        if delta is None or not (_I64_MIN <= cur <= _I64_MAX and _I64_MIN <= delta <= _I64_MAX):
            raise _Refused("add needs a 64-bit integer amount, and a key that holds one")
        # 64-bit, wrapping, as TCPStore's (and a result that is always short to write)
        new = str((cur + delta - _I64_MIN) % (1 << 64) + _I64_MIN).encode()
        self._put(key, new)
        return new

    def _queue(self, peer: bytes, req: w.StoreRequest, now: float
               ) -> list[tuple[bytes, w.StoreReply]]:
        if len(req.keys) != 1:
            raise _Refused("a queue request takes exactly one key")
        key = req.keys[0]
        q = self.queues.get(key)
        if req.op == w.S_QUEUE_LEN:
            return [(peer, w.StoreReply(w.R_OK, req.req_id, (str(len(q or ())).encode(),)))]
        if req.op == w.S_QUEUE_PUSH:
            if len(req.values) != 1:
                raise _Refused("queue_push takes one value")
            v = req.values[0]
            lim = self.limits
            if len(self.data) + self.queued >= lim.max_keys:
                raise _Refused(f"the store is full: it holds {lim.max_keys} keys and queued "
                               "values (its max_keys)")
            more = len(v) + (len(key) if q is None else 0)
            if self.held + more > lim.max_total_bytes:
                raise _Refused(self._full(more))
            if q is None:
                q = self.queues[key] = deque()
            q.append(v)
            self.queued += 1
            self.held += more
            # every pop parked on it is told to look again (_wake: a reply without a value),
            # and the value stays queued until a pop takes it: a value handed to a parked
            # pop was lost where its client had gone, or given up (killed, interrupted,
            # closed, past its deadline), as nothing acknowledges a reply; a wait() for the
            # queue's name is answered too
            return [(peer, w.StoreReply(w.R_OK, req.req_id))] + self._wake()
        if q:  # a pop
            v = q.popleft()
            self.queued -= 1
            self.held -= len(v)
            if not q:
                del self.queues[key]
                self.held -= len(key)
            return [(peer, w.StoreReply(w.R_OK, req.req_id, (v,)))]
        return self._park(peer, req, now)

    def n_poppers(self) -> int:
        """How many pops wait (for the tests)."""
        return sum(wt.req.op == w.S_QUEUE_POP for wt in self.waiters)

    def _wake(self) -> list[tuple[bytes, w.StoreReply]]:
        out, keep = [], []
        for wt in self.waiters:
            if self._waited(wt.req):
                keep.append(wt)
            else:
                self.held -= wt.size
                out.append(self._answer(wt.peer, wt.req))
        self.waiters = keep
        return self._remember(out)

    def expire(self, now: float) -> list[tuple[bytes, w.StoreReply]]:
        out, keep = [], []
        for wt in self.waiters:
            if wt.deadline <= now:
                self.held -= wt.size
                out.append((wt.peer, w.StoreReply(w.R_TIMEOUT, wt.req.req_id,
                                                  tuple(self._waited(wt.req)))))
            else:
                keep.append(wt)
        self.waiters = keep
        return self._remember(out)

    def next_deadline(self) -> float | None:
        return min((wt.deadline for wt in self.waiters), default=None)

    def forget_peer(self, peer: bytes) -> None:
        keep = []
        for wt in self.waiters:
            if wt.peer == peer:
                self.held -= wt.size
            else:
                keep.append(wt)
        self.waiters = keep


# ops that only read: a formation's member may read another rank's key
_READS = frozenset({w.S_GET, w.S_WAIT, w.S_CHECK})
# the largest reply kept for a resend of its request (see StoreState._remember): with one
# kept per client, for max_connections clients, 16 MiB at most by default
KEEP_REPLY = 4096
_NOT_KEPT = w.StoreReply(w.R_ERROR, -1)


class _Refused(Exception):
    pass
