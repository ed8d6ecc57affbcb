"""Rendezvous store: a key-value state machine (pure) and its client.

The store only forms groups (ranks publish their endpoints, rank 0 publishes the table); it is
never the data plane. :class:`StoreState` is the server's logic with no sockets and no clock of
its own (callers pass ``now``); :mod:`ctrlcomm._transport` runs it on a socket in a thread.
Waiting requests (``get`` of missing keys, ``wait``) are parked until their keys exist or their
deadline passes; the reply then says which keys were missing.
"""

from __future__ import annotations

import itertools
import operator
import struct
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from . import _wire as w
from ._errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    StoreError,
    StoreKeyError,
    StoreQueueEmptyError,
    StoreTimeoutError,
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
        op, keys, vals = req.op, req.keys, req.values
        for k in keys:
            if len(k) > MAX_KEY:
                raise _Refused(f"key longer than {MAX_KEY} bytes")
        for v in vals:
            if len(v) > self.limits.max_value_bytes:
                raise _Refused(f"a value of {len(v)} bytes is over the store's "
                               f"max_value_bytes ({self.limits.max_value_bytes})")
        self._allowed(peer, req)
        if op == w.S_PING:
            return [(peer, w.StoreReply(w.R_OK, req.req_id))]
        if op == w.S_NUM_KEYS:
            return [(peer, w.StoreReply(w.R_OK, req.req_id, (str(len(self.data)).encode(),)))]
        if op == w.S_LIST_KEYS:
            prefix = keys[0] if keys else b""
            listed = b"".join(_KEY_LEN.pack(len(k)) + k for k in self.data
                              if k.startswith(prefix) and self._may_see(peer, k))
            return [(peer, w.StoreReply(w.R_OK, req.req_id, (listed,)))]
        if op in (w.S_GET, w.S_WAIT):
            if not self._missing(keys):
                return [self._answer(peer, req)]
            return self._park(peer, req, now)
        if op in (w.S_QUEUE_PUSH, w.S_QUEUE_POP, w.S_QUEUE_LEN):
            return self._queue(peer, req, now)
        if op == w.S_CHECK:
            return [(peer, w.StoreReply(w.R_OK, req.req_id,
                                        tuple(b"0" if self._missing((k,)) else b"1"
                                              for k in keys)))]
        if op in (w.S_DELETE, w.S_DELETE_PREFIX):
            if op == w.S_DELETE:
                gone = [k for k in keys if self._delete(k)]
            else:
                prefix = keys[0] if keys else b""
                gone = [k for k in list(self.data)
                        if k.startswith(prefix) and self._may_change(peer, k) and self._delete(k)]
            return [(peer, w.StoreReply(w.R_OK, req.req_id, (str(len(gone)).encode(),)))]
        if len(keys) != 1:
            raise _Refused("this request takes exactly one key")
        key = keys[0]
        replies: list[tuple[bytes, w.StoreReply]]
        if op == w.S_SET:
            if len(vals) != 1:
                raise _Refused("set takes one value")
            self._put(key, vals[0])
            replies = [(peer, w.StoreReply(w.R_OK, req.req_id))]
        elif op == w.S_ADD:
            try:
                delta = int(vals[0]) if len(vals) == 1 else None
                cur = int(self.data.get(key, b"0"))
            except ValueError:
                delta = None
            if delta is None or not (_I64_MIN <= cur <= _I64_MAX and
                                     _I64_MIN <= delta <= _I64_MAX):
                raise _Refused("add needs a 64-bit integer amount, and a key that holds one")
            # 64-bit, wrapping, as TCPStore's (and a result that is always short to write)
            new = str((cur + delta - _I64_MIN) % (1 << 64) + _I64_MIN).encode()
            self._put(key, new)
            replies = [(peer, w.StoreReply(w.R_OK, req.req_id, (new,)))]
        elif op == w.S_CAS:
            if len(vals) != 3:
                raise _Refused("compare_set takes (expect_absent, expected, desired)")
            absent, expected, desired = vals[0] == b"1", vals[1], vals[2]
            held = self.data.get(key)
            if (held is None and (absent or expected == b"")) or (held is not None and not absent
                                                                   and held == expected):
                self._put(key, desired)
                if held is None:
                    self._joined(peer, key)
                replies = [(peer, w.StoreReply(w.R_OK, req.req_id, (desired,)))]
            else:
                now_val = () if held is None else (held,)
                replies = [(peer, w.StoreReply(w.R_CAS_FAIL, req.req_id, now_val))]
        else:  # pragma: no cover - decode_store_request only lets known ops through
            raise _Refused(f"unknown op {op}")
        return replies + self._wake()

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


def _b(x: str | bytes) -> bytes:
    """A key or value as bytes: str (UTF-8), or bytes-like. Anything else is refused, as
    TCPStore does (bytes(n) of an int n would be n zero bytes)."""
    if isinstance(x, str):
        return x.encode()
    if isinstance(x, (bytes, bytearray, memoryview)):
        return bytes(x)
    raise ArgumentTypeError(f"store: a key or value must be str or bytes, not "
                            f"{type(x).__name__}")


def _secs(timeout: Any) -> float:
    """Seconds, from a number or a timedelta (torch's store methods take either; not from
    a str, which float() would read)."""
    if isinstance(timeout, (str, bytes)):
        raise InvalidArgumentError(f"store: timeout {timeout!r} is not a number of seconds "
                                   "or a timedelta")
    if hasattr(timeout, "total_seconds"):
        return float(timeout.total_seconds())
    try:
        return float(timeout)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"store: timeout {timeout!r} is not a number of seconds "
                                   "or a timedelta") from None


# the longest timeout a store call takes (longer ones are this: 30 years)
MAX_TIMEOUT_S = 1e9


def _timeout(timeout: Any, op: str) -> float:
    """A store call's timeout, in seconds (a number or a timedelta), > 0."""
    t = _secs(timeout)
    if not t > 0:  # (NaN too)
        raise InvalidArgumentError(f"store {op}: timeout must be > 0 seconds, got "
                                   f"{show(timeout)}")
    return min(t, MAX_TIMEOUT_S)


def port_arg(port: Any, what: str = "port") -> int:
    """``port``, checked: an int in 1..65535 (InvalidArgumentError naming ``what``)."""
    try:
        port = operator.index(port)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be an int, got {show(port)}") from None
    if not 0 < port < 65536:
        raise InvalidArgumentError(f"{what} must be in 1..65535, got {port}")
    return int(port)


def _key_list(keys: Any, op: str) -> Sequence[str | bytes]:
    """``keys``, a list of keys (one str would be taken as its characters), as TCPStore."""
    if isinstance(keys, (str, bytes, bytearray, memoryview)):
        raise ArgumentTypeError(f"store {op}: keys must be a list of keys, got one "
                                f"{type(keys).__name__} ({show(keys)}): pass [{show(keys)}]")
    return keys  # type: ignore[no-any-return]


# A get or wait of timeout t lets the store wait t for the keys (as TCPStore's do), and its
# reply (a timeout naming the keys still missing) this much longer to come back.
REPLY_SLACK_S = 1.0


def _check_host(host: Any, what: str) -> str:
    """``host``, a str (an IPv6 address in brackets, as in a URL, without them)."""
    if not isinstance(host, str) or not host.strip("[]"):
        raise InvalidArgumentError(f"{what} must be a host name or address (a str), got "
                                   f"{show(host)}")
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _store_host(host: Any, port: Any, timeout: float) -> str:
    """The store's address: ``host`` checked, a name looked up within ``timeout`` seconds.
    Raises StoreError where it does not resolve, StoreTimeoutError where the lookup took
    longer (see _transport.resolve)."""
    from ._transport import resolve

    host = _check_host(host, "host")
    try:
        return resolve(host, timeout)
    except TimeoutError as e:
        raise StoreTimeoutError(f"cannot reach the store at {host}:{port}: {e}",
                                answered=False) from None
    except (OSError, UnicodeError) as e:  # (socket.gaierror; OSError for EAI_SYSTEM)
        raise StoreError(f"cannot reach the store at {host}:{port}: host {host!r} does not "
                         f"resolve ({getattr(e, 'strerror', None) or e})") from None


class StoreClient:
    """Client of a ctrlcomm store at ``(host, port)``. Every call has a deadline.

    Keys are ``str`` (or bytes); values are ``bytes`` (``str`` is encoded as UTF-8), as with
    torch's ``TCPStore``, whose method names are also accepted (``delete_key``, ``check``,
    ``compare_set``, ``wait``). A client may be shared by threads (calls are serialized).

    Args:
        host: the store's address.
        port: the store's port.
        timeout: default deadline in seconds of every call.
        prefix: prepended to every key (namespacing).
        auth_key: the store's key: requests and replies then carry a MAC (a store with a key
            answers nothing else, and this client accepts no unauthenticated reply).
    """

    def __init__(self, host: str, port: int, *, timeout: float = 300.0, prefix: str = "",
                 auth_key: bytes | str | None = None, encrypt: bool = False,
                 _address: str | None = None) -> None:
        from ._transport import store_connection

        _check_host(host, "store: host")
        self.host, self.port, self.prefix = host, port_arg(port, "store: port"), prefix
        self.timeout = _timeout(timeout, "client")
        key = auth_key.encode() if isinstance(auth_key, str) else auth_key
        if encrypt and not key:
            raise InvalidArgumentError("an encrypted store connection needs an auth_key")
        self.encrypt = encrypt
        # a name is looked up here, within the timeout (see _transport.resolve), and ZeroMQ
        # given the number: it would look the name up without a deadline, at every
        # reconnection too (_address: ``host``'s, looked up by the caller already; ``host``
        # is named in errors)
        address = _address or _store_host(host, self.port, self.timeout)
        self._conn = store_connection(address, self.port, key or None, encrypt)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # (held by the call in progress)
        # _closed and _busy (a call is in progress), changed together under _state: close()
        # closes the connection itself where no call is in progress, else wakes the call,
        # which closes it as it ends
        self._state = threading.Lock()
        self._closed = self._busy = False

    def __repr__(self) -> str:
        return f"StoreClient({self.host!r}, {self.port}, prefix={self.prefix!r})"

    @property
    def keyed(self) -> bool:
        """Whether this client signs its requests (an auth_key)."""
        return bool(self._conn.key)

    def _k(self, key: str | bytes) -> bytes:
        return _b(self.prefix) + _b(key)

    def _call(self, op: int, keys: Sequence[bytes], values: Sequence[bytes] = (),
              timeout: float | None = None, wait: float = 0.0) -> w.StoreReply:
        t = self.timeout if timeout is None else _timeout(timeout, w.STORE_OP_NAME.get(op, "call"))
        # (over the limits the store's socket would drop the connection: said here, at once)
        for what, parts, most in (("key", keys, MAX_KEY), ("value", values, MAX_VALUE)):
            for v in parts:
                if len(v) > most:
                    raise InvalidArgumentError(f"store: a {what} of {len(v)} bytes is over "
                                               f"the store's limit of {most} bytes")
        # (a wait beyond the wire's limit, decades, would be dropped as malformed)
        wait = min(wait, w.STORE_MAX_WAIT_S / 2)
        with self._lock:
            try:  # (the flag set inside: whatever interrupts the call, it is cleared)
                with self._state:
                    if self._closed:
                        raise StoreError(f"the store client of {self.host}:{self.port} is "
                                         "closed")
                    self._busy = True
                req = w.StoreRequest(op, next(self._ids) & 0xFFFFFFFF, wait, tuple(keys),
                                     tuple(values))
                rep = self._conn.request(req, deadline=time.monotonic() + t)
            finally:
                with self._state:
                    self._busy = False
                    closed = self._closed
                if closed:  # by another thread, while this request waited: it woke it
                    self._conn.close()
        if rep is None:
            hint = (" (with encryption on, a store that runs without it, or with another "
                    "key, never answers)") if self.encrypt else \
                (" (a store with another auth_key, or none, answers nothing a key signs: "
                 "every rank and the store need the same one)") if self._conn.key else \
                " (is it running? one run with an auth_key answers nothing unsigned)"
            raise StoreTimeoutError(
                f"store at {self.host}:{self.port} did not answer within {t:.1f} s{hint}",
                answered=False)
        if rep.status == w.R_ERROR:
            raise StoreError(f"store at {self.host}:{self.port} refused the request: "
                             f"{rep.values[0].decode(errors='replace') if rep.values else ''}")
        return rep

    def set(self, key: str | bytes, value: str | bytes, *, timeout: float | None = None) -> None:
        self._call(w.S_SET, [self._k(key)], [_b(value)], timeout)

    def get(self, key: str | bytes, *, wait: bool = True, timeout: float | None = None) -> bytes:
        """The value of ``key``; waits up to ``timeout`` for it to be set unless ``wait=False``."""
        return self.multi_get([key], wait=wait, timeout=timeout)[0]

    def multi_get(self, keys: Sequence[str | bytes], *, wait: bool = True,
                  timeout: float | None = None) -> list[bytes]:
        t = self.timeout if timeout is None else _timeout(timeout, "get")
        keys = _key_list(keys, "multi_get")
        rep = self._call(w.S_GET, [self._k(k) for k in keys], (), t + REPLY_SLACK_S,
                         t if wait else 0.0)
        if rep.status == w.R_TIMEOUT:
            missing = [m.decode(errors="replace")[len(self.prefix):] for m in rep.values]
            if not wait:
                raise StoreKeyError(missing[0] if len(missing) == 1 else missing)
            raise StoreTimeoutError(f"store at {self.host}:{self.port}: get timed out after "
                                    f"{t:g} s; missing keys {missing}")
        return list(rep.values)

    def wait(self, keys: Sequence[str | bytes], timeout: float | None = None) -> None:
        """Wait until every key exists. Raises :class:`StoreTimeoutError` naming the missing."""
        t = self.timeout if timeout is None else _timeout(timeout, "wait")  # (or a timedelta)
        keys = _key_list(keys, "wait")
        rep = self._call(w.S_WAIT, [self._k(k) for k in keys], (), t + REPLY_SLACK_S, t)
        if rep.status == w.R_TIMEOUT:
            missing = [m.decode(errors="replace")[len(self.prefix):] for m in rep.values]
            raise StoreTimeoutError(f"store at {self.host}:{self.port}: wait timed out after "
                                    f"{t:g} s; missing keys {missing}")

    def set_timeout(self, timeout: Any) -> None:
        """The default deadline of every call, in seconds or as a timedelta (TCPStore's)."""
        self.timeout = _timeout(timeout, "set_timeout")

    def multi_set(self, keys: Sequence[str | bytes], values: Sequence[str | bytes], *,
                  timeout: float | None = None) -> None:
        """Set each key to its value (TCPStore's; one after the other, not at once)."""
        if len(keys) != len(values):
            raise InvalidArgumentError(f"multi_set: {len(keys)} keys and {len(values)} values")
        for k, v in zip(keys, values, strict=True):
            self.set(k, v, timeout=timeout)

    def append(self, key: str | bytes, value: str | bytes, *,
               timeout: float | None = None) -> None:
        """Append ``value`` to ``key``'s value (set it if absent), atomically (TCPStore's)."""
        add = _b(value)
        try:
            cur: bytes | None = self.get(key, wait=False, timeout=timeout)
        except KeyError:
            cur = None
        while True:
            absent = cur is None
            rep = self._call(w.S_CAS, [self._k(key)],
                             [b"1" if absent else b"0", cur or b"", (cur or b"") + add], timeout)
            if rep.status == w.R_OK:
                return
            # changed meanwhile (or deleted): again from what it holds now (no value: absent)
            cur = rep.values[0] if rep.values else None

    def add(self, key: str | bytes, amount: int, *, timeout: float | None = None) -> int:
        """Add ``amount`` to the 64-bit integer ``key`` holds (0 if absent), wrapping as
        TCPStore's add does; returns the new value."""
        try:  # (an int, as TCPStore's: 1.5 or "7" are refused, not cut or parsed)
            n = operator.index(amount)
        except TypeError:
            raise ArgumentTypeError(f"store add of {key!r}: the amount must be an int, got "
                                    f"a {type(amount).__name__} ({show(amount)})") from None
        if not _I64_MIN <= n <= _I64_MAX:
            raise InvalidArgumentError(f"store add of {key!r}: the amount must be a 64-bit "
                                       f"integer, got one of {n.bit_length()} bits")
        return int(self._call(w.S_ADD, [self._k(key)], [str(n).encode()], timeout).values[0])

    def compare_set(self, key: str | bytes, expected: str | bytes | None, desired: str | bytes, *,
                    timeout: float | None = None) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``None`` or ``""``: if absent).

        Returns what ``TCPStore.compare_set`` returns: the value the key holds afterwards,
        or, where it is absent and stays so (``expected`` given and not empty), ``expected``.
        """
        absent = expected is None
        rep = self._call(w.S_CAS, [self._k(key)],
                         [b"1" if absent else b"0", b"" if absent else _b(expected or b""), _b(desired)],
                         timeout)
        if rep.values:
            return rep.values[0]
        return _b(expected) if expected else b""

    def set_if_absent(self, key: str | bytes, value: str | bytes, *,
                      timeout: float | None = None) -> tuple[bool, bytes]:
        """Atomically set ``key`` unless it exists: (whether it was set, value it holds)."""
        rep = self._call(w.S_CAS, [self._k(key)], [b"1", b"", _b(value)], timeout)
        return rep.status == w.R_OK, (rep.values[0] if rep.values else b"")

    def delete(self, key: str | bytes, *, timeout: float | None = None) -> bool:
        return int(self._call(w.S_DELETE, [self._k(key)], (), timeout).values[0]) > 0

    delete_key = delete

    def multi_delete(self, keys: Sequence[str | bytes], *, timeout: float | None = None) -> int:
        """Delete each of ``keys`` (in one request); returns how many existed."""
        keys = _key_list(keys, "multi_delete")
        return int(self._call(w.S_DELETE, [self._k(k) for k in keys], (), timeout).values[0])

    def delete_prefix(self, prefix: str | bytes, *, timeout: float | None = None) -> int:
        return int(self._call(w.S_DELETE_PREFIX, [self._k(prefix)], (), timeout).values[0])

    def check(self, keys: Sequence[str | bytes], *, timeout: float | None = None) -> bool:
        """Whether every key exists (no waiting)."""
        return all(self.exists(_key_list(keys, "check"), timeout=timeout))

    def exists(self, keys: Sequence[str | bytes], *, timeout: float | None = None) -> list[bool]:
        keys = _key_list(keys, "exists")
        rep = self._call(w.S_CHECK, [self._k(k) for k in keys], (), timeout)
        return [v == b"1" for v in rep.values]

    def ping(self, *, timeout: float | None = None) -> None:
        self._call(w.S_PING, [], (), timeout)

    def num_keys(self, *, timeout: float | None = None) -> int:
        """How many keys the store holds, every client's (TCPStore's; as with its
        PrefixStore, a client's ``prefix`` does not narrow the count). A group's formation
        keeps a few keys of its own there."""
        return int(self._call(w.S_NUM_KEYS, [], (), timeout).values[0])

    def list_keys(self, *, timeout: float | None = None) -> list[str]:
        """The keys the store holds under this client's ``prefix``, without it (TCPStore's;
        in no particular order)."""
        prefix = _b(self.prefix)
        rep = self._call(w.S_LIST_KEYS, [prefix], (), timeout)
        data, out, at, cut = rep.values[0], [], 0, len(prefix)
        while at < len(data):
            (n,) = _KEY_LEN.unpack_from(data, at)
            at += _KEY_LEN.size
            out.append(data[at + cut:at + n].decode(errors="replace"))
            at += n
        return out

    def queue_push(self, key: str | bytes, value: str | bytes, *,
                   timeout: float | None = None) -> None:
        """Append ``value`` to the queue ``key`` (TCPStore's). Queues are apart from the
        keys (a key and a queue may share a name; ``num_keys``, ``list_keys`` and
        ``delete_key`` do not see queues), but, as in TCPStore, ``check`` and ``wait`` see
        a queue that holds values, and ``get`` of a name that is only such a queue gives
        ``b""``."""
        self._call(w.S_QUEUE_PUSH, [self._k(key)], [_b(value)], timeout)

    def queue_pop(self, key: str | bytes, block: bool = True, *,
                  timeout: float | None = None) -> bytes:
        """Take the first value of the queue ``key`` (TCPStore's). Where it is empty: with
        ``block``, waits up to ``timeout`` for a push, then raises
        :class:`StoreTimeoutError`; without, raises :class:`StoreQueueEmptyError` at once.
        (Each value goes to one pop. A push wakes the pops that wait, which pop again: the
        value stays queued until one takes it, never handed to a pop whose caller has gone
        or given up.)"""
        t = self.timeout if timeout is None else _timeout(timeout, "queue_pop")
        k, deadline = self._k(key), time.monotonic() + t
        while True:
            wait = max(deadline - time.monotonic(), 0.0) if block else 0.0
            rep = self._call(w.S_QUEUE_POP, [k], (), wait + REPLY_SLACK_S, wait)
            if rep.status == w.R_TIMEOUT:
                if not block:
                    raise StoreQueueEmptyError(f"store at {self.host}:{self.port}: queue "
                                               f"{key!r} is empty")
                raise StoreTimeoutError(f"store at {self.host}:{self.port}: queue_pop of "
                                        f"{key!r} timed out after {t:g} s (nothing was pushed)")
            if rep.values:
                return rep.values[0]
            # (woken by a push: another pop may have taken it first; looks again)

    def queue_len(self, key: str | bytes, *, timeout: float | None = None) -> int:
        """How many values the queue ``key`` holds (TCPStore's; 0 for one never pushed to)."""
        return int(self._call(w.S_QUEUE_LEN, [self._k(key)], (), timeout).values[0])

    def close(self) -> None:
        """Close the connection; a call waiting in another thread raises StoreError (never
        blocks: that call closes it as it ends)."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            busy = self._busy
        if busy:
            self._conn.interrupt()
        else:
            self._conn.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
