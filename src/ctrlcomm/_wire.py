"""Framing: messages to frames and frames to messages. No sockets, no clocks, no asyncio.

A group message is a list of frames (one ZeroMQ multipart message)::

    [header, payload, oob_0, ..., oob_{n-1}, (mac)]

``header`` is a fixed :data:`HEADER` struct (magic, version, kind, op, codec, flags, src,
group id, seq, round/tag, root, number of out-of-band buffers). ``payload`` is the encoded
object; large bytes-like parts of it travel as out-of-band frames (pickle protocol 5), so a
1 MiB buffer is never copied into the pickle stream. The last frame is a MAC, with the group's
key, over every other frame and the rank the message is for, checked before anything is
decoded: a genuine frame sent to one rank is refused by every other (the header names its
sender, not its destination). A group's key is made at its formation (see
``ctrlcomm._group``): every group has one.

Store requests and replies have their own small headers (:data:`STORE_REQ`, :data:`STORE_REP`).

Every decoder here raises :class:`WireError` and nothing else for malformed input.
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ._errors import CodecError, WireError

MAGIC = b"CC"
VERSION = 4  # 2: FLAG_IMMUTABLE (a rank of version 1 drops such messages as malformed); 3: a
# failed reduction carries the ranks it combined (a rank of version 2 cannot decode it); 4:
# every message carries a MAC (a group's key is made at formation, with or without auth_key)
STORE_VERSION = 2  # the store's requests and replies (2: a keyed one's MAC, see _mac_state)
HEADER = struct.Struct("<2sBBBBHIQQqiH")

# kinds
COLL = 1  # collective traffic, matched by (seq, round, src)
P2P = 2  # point to point, matched by (src, tag)
STATUS_REQ = 3  # "what are you doing?" (from a collective that has waited 1 s, and again,
# and from a wait about to time out)
STATUS_REP = 4  # the answer: payload is a short text; header: see STATUS_IN_CALL
ABORT = 5  # the sender aborted the group; payload is the reason
BYE = 6  # the sender closed the group
HELLO = 7  # the first message on a stream connection: who sends on it (no payload)
KINDS = frozenset({COLL, P2P, STATUS_REQ, STATUS_REP, ABORT, BYE, HELLO})

# A STATUS_REP's round says what its seq, op and root are: the collective the sender is in
# (STATUS_IN_CALL), the last one it returned from (STATUS_RETURNED), or nothing (0)
STATUS_IN_CALL = 1
STATUS_RETURNED = 2
# An ABORT whose round is this reports a mismatch (payload: its description, after the
# mismatch prefix) that its sender found by asking the ranks it waited for in collective #seq
# (what they said they were in), not from a message
ABORT_BY_PROBE = 1
# An ABORT whose round is this concerns collective #seq (the one cancelled, interrupted or
# failed on its sender, or the next one it would have made): a rank in that call, or a later
# one, fails it even where its messages are all in; one in an earlier call completes that
# (the sender's part of it is whole) and fails the next
ABORT_AT_CALL = 2

# codecs
RAW = 0  # payload is bytes, used for control messages
PICKLE = 1
MSGPACK = 2
CODECS = frozenset({RAW, PICKLE, MSGPACK})

FLAG_MAC = 1
# Every out-of-band buffer of the message is immutable on the sender (bytes: w.immutable), so
# the receiver keeps each as bytes (a large bytes object is then unpickled onto its frame, not
# copied again); without it they become writable bytearrays (_writable)
FLAG_IMMUTABLE = 2
FLAG_IMMUTABLE_AT = 6  # its byte in the header
MAC_SIZE = 16
NO_ROOT = -1
MAX_OOB = 1024

# Buffers at least this large travel out of band (as their own frame, not copied into the
# pickle). Small ones stay in band: per-frame overhead dominates for them (mpi4py pkl5 notes).
OOB_THRESHOLD = 64 * 1024

# op codes carried in COLL headers, so a rank can tell which collective a peer is in
OPS = (
    "barrier",
    "broadcast",
    "gather",
    "all_gather",
    "scatter",
    "reduce",
    "all_reduce",
    "all_to_all",
)
OP_CODE = {name: i + 1 for i, name in enumerate(OPS)}
OP_NAME = {code: name for name, code in OP_CODE.items()}


class Message(NamedTuple):
    """One decoded group message (payload still encoded). A named tuple: immutable, and
    built in a third of the time of a frozen dataclass (one is built per message)."""

    kind: int
    src: int
    group_id: int
    seq: int
    round: int
    op: int = 0
    root: int = NO_ROOT
    codec: int = RAW
    payload: Any = b""  # bytes-like (bytes, or a bytearray from StreamDecoder.messages)
    buffers: tuple[Any, ...] = ()


_TO = struct.Struct("<2sq")  # what follows the frames in a MAC's input: b"to", the rank


_keyed: dict[bytes, Any] = {}  # a keyed hash, for each key, to copy (cheaper than keying one)


def _hash(key: bytes) -> Any:
    """A new keyed hash of the MAC (BLAKE2b, 16 bytes) with ``key``."""
    h = _keyed.get(key)
    if h is None:
        if len(_keyed) >= 256:  # (keys of groups long closed: made again where needed)
            _keyed.clear()
        h = _keyed[key] = hashlib.blake2b(key=key, digest_size=MAC_SIZE)
    return h.copy()


def _mac_state(key: bytes, frames: Sequence[Any]) -> Any:
    """The MAC's hash over ``frames``, a message's frames but its MAC: their stream framing
    (:func:`stream_prefix` of the frames and the MAC, then the frames; so the input splits
    one way only, and it is the very bytes a stream sends, hashed in one go where they are
    at hand: :func:`stream_messages`, :meth:`StreamDecoder.messages`); the destination
    comes after it (:func:`_mac`)."""
    h = _hash(key)
    h.update(stream_prefix_lens([memoryview(f).nbytes for f in frames] + [MAC_SIZE]))
    for f in frames:
        h.update(f)
    return h


_to_bytes: dict[int, bytes] = {}


def _to(dst: int) -> bytes:
    """What follows a message's frames in its MAC's input: b"to", the rank it is for."""
    t = _to_bytes.get(dst)
    if t is None:
        if len(_to_bytes) >= 4096:
            _to_bytes.clear()
        t = _to_bytes[dst] = _TO.pack(b"to", dst)
    return t


def _mac(key: bytes, frames: Sequence[Any], dst: int) -> bytes:
    h = _mac_state(key, frames)
    h.update(_to(dst))
    return h.digest()  # type: ignore[no-any-return]


def encode(msg: Message, key: bytes | None = None, dst: int = -1) -> list[Any]:
    """Frames for ``msg`` (payload already encoded), with a MAC frame when ``key`` is set,
    valid at rank ``dst`` only."""
    return frames(*msg, key=key, dst=dst)


def frames(kind: int, src: int, group_id: int, seq: int, rnd: int, op: int, root: int,
           codec: int, payload: Any, buffers: tuple[Any, ...] = (), key: bytes | None = None,
           dst: int = -1) -> list[Any]:
    """:func:`encode` of the message with these fields, without building the message."""
    if key:
        return frames_for((dst,), kind, src, group_id, seq, rnd, op, root, codec, payload,
                          buffers, key)[0]
    if not buffers:
        return [HEADER.pack(MAGIC, VERSION, kind, op, codec, 0, src, group_id, seq, rnd, root,
                            0), payload]
    header = HEADER.pack(MAGIC, VERSION, kind, op, codec, _buffer_flags(buffers), src,
                         group_id, seq, rnd, root, len(buffers))
    return [header, payload, *buffers]


def _buffer_flags(buffers: Sequence[Any]) -> int:
    return FLAG_IMMUTABLE if buffers and all(immutable(b) for b in buffers) else 0


def sign_each(frames: list[Any], key: bytes, dsts: Sequence[int]) -> list[list[Any]]:
    """``frames`` of one message (from :func:`frames` without a key, but with the MAC flag
    set: see :func:`frames_for`) with a MAC for each of ``dsts``, in that order: the hash
    over the frames is computed once."""
    h = _mac_state(key, frames)
    out = []
    for d in dsts:
        hd = h.copy()
        hd.update(_TO.pack(b"to", d))
        out.append([*frames, hd.digest()])
    return out


def frames_for(dsts: Sequence[int], kind: int, src: int, group_id: int, seq: int, rnd: int,
               op: int, root: int, codec: int, payload: Any, buffers: tuple[Any, ...],
               key: bytes) -> list[list[Any]]:
    """The frames of one message for each of ``dsts`` (with ``key``: each its own MAC)."""
    header = HEADER.pack(MAGIC, VERSION, kind, op, codec, FLAG_MAC | _buffer_flags(buffers),
                         src, group_id, seq, rnd, root, len(buffers))
    return sign_each([header, payload, *buffers], key, dsts)


def decode_or_none(frames: Sequence[Any], key: bytes | None = None, dst: int = -1
                   ) -> Message | None:
    """:func:`decode`, or ``None`` for a malformed or unauthenticated message."""
    try:
        return decode(frames, key, dst)
    except WireError:
        return None


def decode(frames: Sequence[Any], key: bytes | None = None, dst: int = -1) -> Message:
    """Parse and authenticate frames (with ``key``: sent to rank ``dst``, this rank). Raises
    :class:`WireError` for anything malformed."""
    if len(frames) < 2:
        raise WireError(f"expected at least 2 frames, got {len(frames)}")
    head = frames[0]
    try:
        if memoryview(head).nbytes != HEADER.size:
            raise WireError("bad header size")
        (magic, version, kind, op, codec, flags, src, gid, seq, rnd, root, nbuf) = (
            HEADER.unpack_from(head)
        )
    except (struct.error, TypeError) as e:
        raise WireError(f"bad header: {e}") from None
    if magic != MAGIC:
        raise WireError("bad magic")
    if version != VERSION:
        raise WireError(f"unsupported version {version}")
    if kind not in KINDS:
        raise WireError(f"unknown kind {kind}")
    if codec not in CODECS:
        raise WireError(f"unknown codec {codec}")
    has_mac = bool(flags & FLAG_MAC)
    if flags & ~(FLAG_MAC | FLAG_IMMUTABLE):
        raise WireError(f"unknown flags {flags:#x}")
    if flags & FLAG_IMMUTABLE and not nbuf:
        raise WireError("immutable-buffers flag without buffers")
    if nbuf > MAX_OOB or len(frames) != 2 + nbuf + has_mac:
        raise WireError(f"frame count {len(frames)} does not match header ({nbuf} buffers)")
    if key:
        if not has_mac:
            raise WireError("unauthenticated frame")
        want = _mac(key, frames[:-1], dst)
        got = frames[-1]
        if memoryview(got).nbytes != MAC_SIZE or not hmac.compare_digest(want, bytes(got)):
            raise WireError("bad MAC")  # (or one made for another rank)
    elif has_mac:
        raise WireError("authenticated frame on a group without a key")
    return Message(kind, src, gid, seq, rnd, op, root, codec, frames[1],
                   () if not nbuf else tuple(frames[2 : 2 + nbuf]) if flags & FLAG_IMMUTABLE
                   else _writable(frames[2 : 2 + nbuf]))


def immutable(buf: Any) -> bool:
    """Whether ``buf`` (a frame to send) can never change: bytes, or a view of bytes. A
    transport may send only such a frame after its send call has returned (queued, or by
    ZeroMQ's I/O thread) without a copy: an array's or a bytearray's memory may be changed
    by the caller as soon as the call returns, and what was sent must not change with it."""
    return type(buf) is bytes or (type(buf) is memoryview and type(buf.obj) is bytes)


def _writable(bufs: Sequence[Any]) -> tuple[Any, ...]:
    """A message's out-of-band buffers (not FLAG_IMMUTABLE), each writable: what is unpickled
    onto them is what the receiver owns, as a numpy array unpickled from an in-band pickle
    (or by mpi4py, or torch.distributed's object collectives) is: writable. The stream
    decoder makes them bytearrays already (the one copy out of the receive buffer); a frame of
    another transport that is read-only (bytes, from ZeroMQ) is copied into one."""
    return tuple(b if type(b) is bytearray or not memoryview(b).readonly else bytearray(b)
                 for b in bufs)


# --------------------------------------------------------------------- control payloads

ABORT_OWN, ABORT_LOST, ABORT_MISMATCH = 0, 1, 2  # AbortReason.kind
_ABORT_MARKS = {ABORT_LOST: "\x00lost:", ABORT_MISMATCH: "\x00mismatch:"}


class AbortReason(NamedTuple):
    """An ABORT message's payload: why its sender broke the group.

    ``kind``: ABORT_OWN (an abort of the sender's own: ``text`` says why), ABORT_LOST (the
    sender lost ``ranks``; ``text``: its error), ABORT_MISMATCH (the sender found the ranks
    out of step; ``text`` describes how). As text: a marked one begins with NUL, its mark
    ("lost:" and the ranks, comma-separated, then "|"; "mismatch:"), then ``text``; any
    other text is the sender's own reason, as a peer of an earlier version reads it.
    """

    kind: int
    text: str
    ranks: tuple[int, ...] = ()

    def encode(self) -> bytes:
        if self.kind == ABORT_LOST:
            return f"{_ABORT_MARKS[ABORT_LOST]}{','.join(map(str, self.ranks))}|{self.text}".encode()
        return (_ABORT_MARKS.get(self.kind, "") + self.text).encode()


def decode_abort(payload: Any) -> AbortReason:
    """The reason an ABORT's payload gives. Never raises: a payload that is no marked reason
    is the sender's own words (undecodable bytes replaced), and a rank that is no decimal
    number is left out of ``ranks``."""
    text = bytes(payload).decode(errors="replace")
    if text.startswith(_ABORT_MARKS[ABORT_MISMATCH]):
        return AbortReason(ABORT_MISMATCH, text[len(_ABORT_MARKS[ABORT_MISMATCH]):])
    if text.startswith(_ABORT_MARKS[ABORT_LOST]):
        head, _, rest = text[len(_ABORT_MARKS[ABORT_LOST]):].partition("|")
        # (isdecimal: what int() takes; "²".isdigit() is true)
        ranks = tuple(int(x) for x in head.split(",") if x.strip().isdecimal())
        return AbortReason(ABORT_LOST, rest, ranks)
    return AbortReason(ABORT_OWN, text)


def said(payload: Any) -> str:
    """A control message's words (a BYE's why its sender's group broke, if it did; a
    STATUS_REP's account): UTF-8. Never raises: undecodable bytes are replaced."""
    return bytes(payload).decode(errors="replace")


class Status(NamedTuple):
    """A STATUS_REP: what its sender is doing, in answer to a STATUS_REQ.

    ``where``: STATUS_IN_CALL (it is in collective #``seq``, of ``op`` and ``root``),
    STATUS_RETURNED (that is the last one it returned from) or 0 (neither: the numbers are
    0 and NO_ROOT); ``text``: the same in words, for an error to quote. The numbers travel in
    the header (``where`` as its round), the words as the payload (:meth:`encode`)."""

    where: int
    seq: int
    op: int
    root: int
    text: str

    def encode(self) -> bytes:
        return self.text.encode()


def decode_status(m: Message) -> Status:
    """The status a STATUS_REP says. Never raises: a ``where`` this release does not know
    reads as 0 (its numbers then say nothing)."""
    if m.round in (STATUS_IN_CALL, STATUS_RETURNED):
        return Status(m.round, m.seq, m.op, m.root, said(m.payload))
    return Status(0, 0, 0, NO_ROOT, said(m.payload))


ALIKE = ("ws", "codec", "tr", "wire")  # the fields every rank of a group must have alike


class AddressRecord(NamedTuple):
    """A rank's line of a formation's address table: where its peers reach it, and what
    every rank must have alike.

    As text, fields separated by single spaces: the endpoint ("tcp://host:port"; "*" for a
    host: see Group.create), the heartbeat's UDP port, then ``fields``, each "name:value":
    the transport's own ("unix:...", "curve:..."), "proc:host:pid:start" (which process of
    which host), the settings every rank must have alike (:data:`ALIKE`: "ws:", "codec:",
    "tr:", "wire:") and "join:" (this try's own token). Fields of names a release does not
    know are kept, and ignored.
    """

    endpoint: str
    udp_port: int
    fields: tuple[str, ...] = ()

    def encode(self) -> str:
        return " ".join((self.endpoint, str(self.udp_port), *self.fields))

    def named(self, *names: str) -> list[str]:
        """The fields of those names, whole ("name:value"), in order."""
        marks = tuple(n + ":" for n in names)
        return [f for f in self.fields if f.startswith(marks)]

    def alike(self) -> dict[str, str]:
        """The settings every rank must have alike, by name (those it has)."""
        return {k: v for k, _, v in (f.partition(":") for f in self.fields) if k in ALIKE}


def decode_address(text: str) -> AddressRecord:
    """The record of an address line; WireError where it has no endpoint and port."""
    parts = text.split(" ")
    if len(parts) < 2 or not parts[0] or not parts[1].isdecimal() or int(parts[1]) > 65535:
        raise WireError(f"not an address record: {text[:80]!r}")
    if any(not f or ":" not in f for f in parts[2:]):
        raise WireError(f"an address record with a field that is not name:value: {text[:80]!r}")
    return AddressRecord(parts[0], int(parts[1]), tuple(parts[2:]))


# ----------------------------------------------------------------------------------- codecs


class _OutOfBand:
    """Pickles a large bytes/bytearray as a PickleBuffer (the pickler fast-paths both types
    in band, and never asks ``reducer_override`` about them)."""

    __slots__ = ("obj",)

    def __init__(self, obj: bytes | bytearray) -> None:
        self.obj = obj

    def __reduce_ex__(self, protocol: Any) -> Any:
        if type(self.obj) is bytes:
            return _bytes_of, (pickle.PickleBuffer(self.obj),)
        return _bytearray_of, (pickle.PickleBuffer(self.obj),)


def _bytes_of(buf: Any) -> bytes:
    """Unpickles an out-of-band bytes object: the received frame itself when it is one (the
    unpickler hands over the buffer object it was given), else a copy (a received frame is a
    writable bytearray, :func:`_writable`, seen here through a read-only view)."""
    return buf if type(buf) is bytes else bytes(buf)


def _bytearray_of(buf: Any) -> bytearray:
    """Unpickles an out-of-band bytearray: the received frame itself when it is one (no
    second copy of a large one), else a copy."""
    return buf if type(buf) is bytearray else bytearray(buf)


def _wrap_large(obj: Any, depth: int = 0) -> Any:
    t = type(obj)
    if t in (bytes, bytearray):
        return _OutOfBand(obj) if len(obj) >= OOB_THRESHOLD else obj
    if depth >= 4:
        return obj
    if t is dict:
        return {k: _wrap_large(v, depth + 1) for k, v in obj.items()}
    if t is list:
        return [_wrap_large(v, depth + 1) for v in obj]
    if t is tuple:
        return tuple(_wrap_large(v, depth + 1) for v in obj)
    return obj


_pdumps = pickle.dumps
_ploads = pickle.loads
_NO_BUFS: tuple[Any, ...] = ()


class _Large(Exception):
    """Raised by :func:`_small_buffers_only` to stop a first pickling pass."""


def _small_buffers_only(pb: pickle.PickleBuffer) -> bool:
    """The first pass's buffer callback: small buffers stay in band; a large one (a numpy
    array, say) ends the pass at once instead of being copied into it."""
    if pb.raw().nbytes >= OOB_THRESHOLD:
        raise _Large
    return True


def dumps_large(obj: Any) -> tuple[Any, tuple[Any, ...]]:
    """:func:`dumps` of a pickled object that is large, or holds something large (its first
    pass gave 64 KiB or more, or met a large buffer, or it is large bytes): pickled again,
    passing large buffers out of band (bytes and bytearray objects, which the pickler keeps
    in band, wrapped; arrays that pickle as PickleBuffers through the callback)."""
    bufs: list[Any] = []

    def keep_large(pb: pickle.PickleBuffer) -> bool:
        raw = pb.raw()
        if raw.nbytes >= OOB_THRESHOLD:
            bufs.append(raw)
            return False
        return True

    try:
        data = _pdumps(_wrap_large(obj), protocol=5, buffer_callback=keep_large)
    except Exception as e:
        raise cannot_pickle(obj, e) from e
    return data, tuple(bufs)


def cannot_pickle(obj: Any, e: Exception) -> CodecError:
    """The error of ``obj`` that pickling raised ``e`` on (raised ``from e``)."""
    return CodecError(f"cannot pickle {type(obj).__name__}: {e}")


LARGE = object()  # what first_pass says of a large object


def first_pass(obj: Any) -> Any:
    """Pickle ``obj`` if it is small, with nothing large in it: its pickle (bytes, under
    64 KiB: the usual control message, all :func:`dumps` makes of it), :data:`LARGE` (it
    is large, or holds something large: :func:`dumps_large` encodes it), or the exception
    pickling raised (:func:`cannot_pickle` says it). (For a caller that goes on with what
    the pass found: nothing is pickled more often than by :func:`dumps`.)"""
    t = type(obj)
    if (t is bytes or t is bytearray) and len(obj) >= OOB_THRESHOLD:
        return LARGE
    try:
        data = _pdumps(obj, 5, buffer_callback=_small_buffers_only)
    except _Large:
        return LARGE
    except Exception as e:  # pickling runs user code: anything can come out
        return e
    return data if len(data) < OOB_THRESHOLD else LARGE


def dumps(obj: Any, codec: int) -> tuple[Any, tuple[Any, ...]]:
    """Encode ``obj``: returns (payload, out-of-band buffers)."""
    if codec == PICKLE:
        data = first_pass(obj)
        if type(data) is bytes:
            return data, _NO_BUFS
        if data is LARGE:
            return dumps_large(obj)
        raise cannot_pickle(obj, data) from data
    if codec == MSGPACK:
        from . import _msgpack

        return _msgpack.dumps(obj), ()
    if codec == RAW:
        return bytes(obj), ()
    raise CodecError(f"unknown codec {codec}")


def loads(payload: Any, buffers: Sequence[Any], codec: int, unpickle: bool = True) -> Any:
    """Decode a payload (authenticated already, where the group has a key). ``codec`` is the
    one the header names: with ``unpickle`` false (a data-only group) a pickled payload is
    refused, not loaded, whatever the sender says."""
    if codec == PICKLE:
        if not unpickle:
            raise CodecError("the payload is pickled, and this group never unpickles (its "
                             "codec is msgpack: every rank of a group must use the same)")
        return _ploads(payload, buffers=buffers)
    if codec == MSGPACK:
        from . import _msgpack

        return _msgpack.loads(payload)
    return bytes(payload)


# ------------------------------------------------------------------------ store protocol

STORE_MAGIC = b"CS"
STORE_MAX_WAIT_S = 1e9  # a request's wait is under this (clients ask for at most half)
STORE_REQ = struct.Struct("<2sBBIdI")  # magic, version, op, request id, timeout s, nkeys
STORE_REP = struct.Struct("<2sBBI")  # magic, version, status, request id

# store ops
S_SET = 1  # keys=[k], values=[v]
S_GET = 2  # keys=[k...]; waits up to timeout for all; reply values
S_ADD = 3  # keys=[k], values=[int as ascii]; reply new value
S_CAS = 4  # keys=[k], values=[expected, new]; empty expected with flag means absent
S_DELETE = 5  # keys=[k...]; reply count deleted
S_WAIT = 6  # keys=[k...]; waits for all to exist
S_DELETE_PREFIX = 7  # keys=[prefix]
S_CHECK = 8  # keys=[k...]; reply b"1"/b"0" each, no wait
S_PING = 9
S_NUM_KEYS = 10  # no keys; reply [count as ascii]
S_LIST_KEYS = 11  # keys=[prefix]; reply [each key held that starts with it: u32 length, bytes]
# queues (TCPStore's queue_*), apart from the keys: a key and a queue of one name are two things
S_QUEUE_PUSH = 12  # keys=[k], values=[v]: appended to queue k
S_QUEUE_POP = 13  # keys=[k]; reply [the first item]; or, waiting up to timeout, [] once one
#                   is pushed (the client pops again: the item is never handed to a waiter)
S_QUEUE_LEN = 14  # keys=[k]; reply [count as ascii]
STORE_OP_NAME = {S_SET: "set", S_GET: "get", S_ADD: "add", S_CAS: "compare_set",
                 S_DELETE: "delete", S_WAIT: "wait", S_DELETE_PREFIX: "delete_prefix",
                 S_CHECK: "check", S_PING: "ping", S_NUM_KEYS: "num_keys",
                 S_LIST_KEYS: "list_keys", S_QUEUE_PUSH: "queue_push",
                 S_QUEUE_POP: "queue_pop", S_QUEUE_LEN: "queue_len"}
STORE_OPS = frozenset(STORE_OP_NAME)

# reply statuses
R_OK = 0
R_TIMEOUT = 1
R_ERROR = 2  # values[0] is a message
R_CAS_FAIL = 3  # values[0] is the current value (or absent)

MAX_STORE_KEYS = 65536
# the longest value the store keeps; a store's socket takes no frame longer than this and a
# key (a frame declared longer ends the connection at once: nobody without the key makes
# the store buffer gigabytes toward a message it would drop)
STORE_MAX_VALUE = 16 * 1024 * 1024
STORE_MAX_FRAME = STORE_MAX_VALUE + 65536


@dataclass(frozen=True, slots=True)
class StoreRequest:
    op: int
    req_id: int
    timeout: float
    keys: tuple[bytes, ...]
    values: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class StoreReply:
    status: int
    req_id: int
    values: tuple[bytes, ...] = ()


def _store_mac(key: bytes, frames: Sequence[Any]) -> bytes:
    return _mac_state(b"store\0" + key, frames).digest()  # type: ignore[no-any-return]


def _check_store_mac(frames: Sequence[Any], key: bytes | None) -> Sequence[Any]:
    """Frames without their MAC; WireError if a keyed store's frame does not carry a good one."""
    if not key:
        return frames
    if len(frames) < 2:
        raise WireError("unauthenticated store frame")
    want = _store_mac(key, frames[:-1])
    got = frames[-1]
    if memoryview(got).nbytes != MAC_SIZE or not hmac.compare_digest(want, bytes(got)):
        raise WireError("bad store MAC")
    return frames[:-1]


def encode_store_request(req: StoreRequest, key: bytes | None = None) -> list[bytes]:
    head = STORE_REQ.pack(STORE_MAGIC, STORE_VERSION, req.op, req.req_id, req.timeout, len(req.keys))
    frames = [head, *req.keys, *req.values]
    return frames + [_store_mac(key, frames)] if key else frames


class UnknownStoreOp(WireError):
    """A well-formed (and, with a key, authentic) store request of an op this version does
    not know: answered, with an error that says so (a client of a later version would
    otherwise wait out its timeout, and blame the address or the key)."""

    def __init__(self, op: int, req_id: int) -> None:
        super().__init__(f"unknown store op {op} (a store of an earlier ctrlcomm version, "
                         "which lacks this call?)")
        self.op, self.req_id = op, req_id


def decode_store_request(frames: Sequence[Any], key: bytes | None = None) -> StoreRequest:
    frames = _check_store_mac(frames, key)
    if not frames:
        raise WireError("empty store request")
    try:
        if memoryview(frames[0]).nbytes != STORE_REQ.size:
            raise WireError("bad store header size")
        magic, version, op, req_id, timeout, nkeys = STORE_REQ.unpack_from(frames[0])
    except (struct.error, TypeError) as e:
        raise WireError(f"bad store header: {e}") from None
    if magic != STORE_MAGIC or version != STORE_VERSION:
        raise WireError("bad store magic or version")
    if op not in STORE_OPS:
        raise UnknownStoreOp(op, req_id)
    if not (timeout >= 0.0 and timeout < STORE_MAX_WAIT_S):  # also rejects NaN
        raise WireError(f"bad store timeout {timeout!r}")
    if nkeys > MAX_STORE_KEYS or len(frames) < 1 + nkeys:
        raise WireError("bad store key count")
    keys = tuple(bytes(f) for f in frames[1 : 1 + nkeys])
    values = tuple(bytes(f) for f in frames[1 + nkeys :])
    return StoreRequest(op, req_id, timeout, keys, values)


def encode_store_reply(rep: StoreReply, key: bytes | None = None) -> list[bytes]:
    frames = [STORE_REP.pack(STORE_MAGIC, STORE_VERSION, rep.status, rep.req_id), *rep.values]
    return frames + [_store_mac(key, frames)] if key else frames


def decode_store_reply(frames: Sequence[Any], key: bytes | None = None) -> StoreReply:
    frames = _check_store_mac(frames, key)
    if not frames:
        raise WireError("empty store reply")
    try:
        if memoryview(frames[0]).nbytes != STORE_REP.size:
            raise WireError("bad store reply size")
        magic, version, status, req_id = STORE_REP.unpack_from(frames[0])
    except (struct.error, TypeError) as e:
        raise WireError(f"bad store reply: {e}") from None
    if magic != STORE_MAGIC or version != STORE_VERSION or status > R_CAS_FAIL:
        raise WireError("bad store reply header")
    return StoreReply(status, req_id, tuple(bytes(f) for f in frames[1:]))


# --------------------------------------------------------- the store's stream (TCP)
#
# A store without a key serves its clients over plain TCP (a store with one, over ZeroMQ with
# CurveZMQ: see ctrlcomm._transport). Each message, both ways: magic "CQ", u32 frame count,
# u32 length per frame, then the frames. A client's first message is its hello: STORE_HELLO
# and its id (16 bytes, random: what the store knows it by across reconnections). The
# decoder enforces the store's limits (frames and bytes of one message) as bytes come, so
# that no client makes it buffer more toward a message it would refuse.

STORE_STREAM_MAGIC = b"CQ"
_STORE_HEAD = struct.Struct("<2sI")
STORE_HELLO = b"ctrlcomm-store-hello"
STORE_ID_SIZE = 16


def store_stream_message(frames: Sequence[bytes]) -> bytes:
    """``frames`` (a store request or reply) framed for the store's stream."""
    n = len(frames)
    return b"".join([_STORE_HEAD.pack(STORE_STREAM_MAGIC, n),
                     struct.pack(f"<{n}I", *map(len, frames)), *frames])


def store_hello(client_id: bytes) -> bytes:
    return store_stream_message([STORE_HELLO, client_id])


def store_hello_id(frames: Sequence[bytes]) -> bytes:
    """The client id of a hello; WireError if ``frames`` are not one."""
    if len(frames) != 2 or frames[0] != STORE_HELLO or len(frames[1]) != STORE_ID_SIZE:
        raise WireError("not a store hello")
    return bytes(frames[1])


class Skipped(NamedTuple):
    """A message :class:`StoreStreamDecoder` did not keep, whose frame of ``size`` bytes
    was larger than it took then (its bytes read and dropped as they came): its first
    frame (a request's header, to answer it), if that was small enough to keep."""

    first: bytes
    size: int


SKIP_KEEP = 256  # a skipped message's first frame is kept up to this size


class StoreStreamDecoder:
    """Incremental decoder of the store's stream: :meth:`feed` takes bytes as they come
    and returns the messages completed. A message of more than ``max_frames`` frames or
    ``max_bytes`` bytes, or anything not this framing, raises :class:`WireError` as soon as
    its prefix says so (and so does every later call). A message with a frame larger than
    ``room()`` says (a store's limits, now) is not kept: its bytes are dropped as they come,
    and it is returned as :class:`Skipped`."""

    def __init__(self, max_frames: int, max_bytes: int,
                 room: Callable[[], int] | None = None) -> None:
        self.max_frames, self.max_bytes, self.room = max_frames, max_bytes, room
        self.buf = bytearray()
        self._lens: tuple[int, ...] | None = None
        self._need = 0
        self._skip = 0  # bytes of a skipped message still to drop
        self.error: WireError | None = None

    def feed(self, data: bytes | memoryview) -> list[list[bytes] | Skipped]:
        if self.error is not None:
            raise self.error
        if self._skip:
            n = min(self._skip, len(data))
            self._skip -= n
            data = memoryview(data)[n:]
        self.buf += data
        out: list[list[bytes] | Skipped] = []
        try:
            self._parse(out)
        except WireError as e:
            self.error = e
            if not out:
                raise
        return out

    def _parse(self, out: list[list[bytes] | Skipped]) -> None:
        buf, pos = self.buf, 0
        while not self._skip:
            if self._lens is None:
                if len(buf) - pos < _STORE_HEAD.size:
                    break
                magic, n = _STORE_HEAD.unpack_from(buf, pos)
                if magic != STORE_STREAM_MAGIC:
                    raise WireError("not the store's stream")
                if not 1 <= n <= self.max_frames:
                    raise WireError(f"a store message of {n} frames (at most "
                                    f"{self.max_frames})")
                head = _STORE_HEAD.size + 4 * n
                if len(buf) - pos < head:
                    break
                lens = struct.unpack_from(f"<{n}I", buf, pos + _STORE_HEAD.size)
                if sum(lens) > self.max_bytes:
                    raise WireError(f"a store message of {sum(lens)} bytes (at most "
                                    f"{self.max_bytes})")
                self._lens, self._need = lens, head
                if self.room is not None and max(lens) > self.room():
                    # not kept: its first frame (to answer it), the rest dropped as it comes
                    keep = lens[0] if lens[0] <= SKIP_KEEP else 0
                    if len(buf) - pos < head + keep:
                        self._lens = None  # (read again once the first frame is in)
                        break
                    first = bytes(buf[pos + head:pos + head + keep])
                    rest = head + sum(lens)
                    have = min(len(buf) - pos, rest)
                    out.append(Skipped(first, max(lens)))
                    pos += have
                    self._skip = rest - have
                    self._lens = None
                    continue
            total = self._need + sum(self._lens)
            if len(buf) - pos < total:
                break
            p = pos + self._need
            frames = []
            with memoryview(buf) as view:
                for ln in self._lens:
                    frames.append(bytes(view[p:p + ln]))
                    p += ln
            out.append(frames)
            pos += total
            self._lens = None
        if pos == len(buf):
            self.buf = bytearray()  # (not a large message's capacity, kept)
        elif pos:
            del buf[:pos]

    def pending(self) -> int:
        """Bytes buffered toward an incomplete message."""
        return len(self.buf)


# ------------------------------------------------------------------ stream framing (TCP)
#
# On a byte stream each message is: magic "CF", u16 frame count, u64 length per frame, then
# the frames back to back. StreamDecoder is fed whatever recv() returned and hands back whole
# messages; it raises WireError (and the connection is dropped) for anything malformed.

STREAM_MAGIC = b"CF"
STREAM_HEAD = struct.Struct("<2sH")
MAX_FRAMES = MAX_OOB + 3
MAX_MESSAGE = 1 << 31  # 2 GiB: a control plane; larger is garbage or an attack


def stream_prefix(frames: Sequence[Any]) -> bytes:
    return stream_prefix_lens([memoryview(f).nbytes for f in frames])


_PREFIX = {n: struct.Struct(f"<2sH{n}Q") for n in range(1, 5)}
# The usual message: header, payload and MAC (no out-of-band buffers). Its stream prefix
# and header, packed and read in one go (stream_messages, StreamDecoder.messages)
_USUAL = _PREFIX[3]
_FAST3 = struct.Struct(_USUAL.format + HEADER.format[1:])
_new_tuple = tuple.__new__
# _FAST3 read with its constant parts as bytes: the prefix's magic, frame count and header
# length; the payload's length; the MAC's length; the header's magic and version
_FASTR = struct.Struct("<12sQ8s3s" + HEADER.format[4:])
_FSIZE = _FASTR.size
_PREFIX_MAX = STREAM_HEAD.size + 8 * MAX_FRAMES  # the longest stream prefix
_LEAD = struct.pack("<2sHQ", STREAM_MAGIC, 3, HEADER.size)
_MAC_LEN = struct.pack("<Q", MAC_SIZE)
_MV = struct.pack("<2sB", MAGIC, VERSION)
assert _FAST3.size == _FSIZE and HEADER.format.startswith("<2sB")
# the start of a read that begins with a usual message, split where usual_expected
# compares it: (the stream prefix but the lengths of payload and MAC, the payload's length,
# the MAC's, the header)
EXPRESS = struct.Struct(f"<12sQ8s{HEADER.size}s")
EXPRESS_SIZE = EXPRESS.size


def usual_header(kind: int, op: int, src: int, group_id: int, seq: int, rnd: int,
                 root: int) -> bytes:
    """The header of the usual message (pickled, MACed, no out-of-band buffers) with these
    fields, as :func:`usual_expected` compares it."""
    return HEADER.pack(MAGIC, VERSION, kind, op, PICKLE, FLAG_MAC, src, group_id, seq, rnd,
                       root, 0)


def usual_expected(buf: bytes | bytearray, got: int, head: bytes, key: bytes, dst: int
                   ) -> int:
    """Where the read ``buf[:got]`` of a stream ends its first message, where that is the
    usual message with header ``head`` (:func:`usual_header`), whole and MACed for rank
    ``dst``; 0 where it is not (another message, one the read cut, or a bad MAC: the
    decoder then takes the read, and says what it is). Its payload is
    ``buf[EXPRESS_SIZE:end - MAC_SIZE]``. For a reader that expects that message and takes it
    apart from the decoder (TcpEndpoint._expected)."""
    if got < EXPRESS_SIZE:
        return 0
    lead, size, mac_len, h = EXPRESS.unpack_from(buf)
    at = EXPRESS_SIZE + size
    end = at + MAC_SIZE
    if lead != _LEAD or mac_len != _MAC_LEN or got < end or h != head:
        return 0
    mac = _hash(key)
    with memoryview(buf) as view:
        mac.update(view[:at])
        mac.update(_to(dst))
        return end if hmac.compare_digest(mac.digest(), view[at:end]) else 0


def stream_messages(dsts: Sequence[int], kind: int, src: int, group_id: int, seq: int,
                    rnd: int, op: int, root: int, codec: int, payload: bytes,
                    key: bytes) -> list[bytes]:
    """The usual message (no out-of-band buffers) in the stream framing, in one piece for
    each of ``dsts`` (each with its MAC): the bytes of :func:`stream_prefix` and
    :func:`frames_for`'s frames joined, the header packed once, the MAC's hash over it and
    the payload made once. What :meth:`StreamDecoder.messages` reads in one go."""
    body = _FAST3.pack(STREAM_MAGIC, 3, HEADER.size, len(payload), MAC_SIZE, MAGIC, VERSION,
                       kind, op, codec, FLAG_MAC, src, group_id, seq, rnd, root, 0) + payload
    h = _hash(key)  # (_mac_state's input: the stream bytes but the MAC, at hand)
    h.update(body)
    if len(dsts) == 1:
        h.update(_to(dsts[0]))
        return [body + h.digest()]
    out = []
    for d in dsts:
        hd = h.copy()
        hd.update(_to(d))
        out.append(body + hd.digest())
    return out


def stream_prefix_lens(lens: Sequence[int]) -> bytes:
    n = len(lens)
    st = _PREFIX.get(n) or struct.Struct(f"<2sH{n}Q")
    return st.pack(STREAM_MAGIC, n, *lens)


def _buffer_type(header: bytes) -> type:
    """What the stream decoder makes a message's frames after the first two of (its
    out-of-band buffers, and a MAC): writable bytearrays where it has buffers that the
    header does not say are immutable (FLAG_IMMUTABLE), so that :func:`decode` need not copy
    them; else bytes (a keyed message's MAC alone, say; or not a message of a group)."""
    if len(header) != HEADER.size or header[FLAG_IMMUTABLE_AT] & FLAG_IMMUTABLE:
        return bytes
    return bytearray if header[-2] | header[-1] << 8 else bytes  # (its buffer count)


class StreamDecoder:
    """Incremental decoder of the stream framing."""

    def __init__(self, max_message: int = MAX_MESSAGE) -> None:
        self.buf = bytearray()
        self.max_message = max_message
        self._lens: tuple[int, ...] | None = None
        self._head = 0  # bytes of prefix for the current message
        self.error: WireError | None = None

    def feed(self, data: bytes | memoryview) -> list[list[bytes]]:
        """Add bytes; return the messages now complete (each a list of frames).

        Malformed input raises :class:`WireError`, unless whole messages came before it in
        this call: those are returned and the error is kept in :attr:`error` (and raised by
        the next call), so good messages ahead of garbage are never lost.
        """
        if self.error is not None:
            raise self.error
        if not self.buf and self._lens is None:
            fast = self._whole(data)
            if fast is not None:
                return fast
        self.buf += data
        out: list[list[bytes]] = []
        try:
            return self._parse(out)
        except WireError as e:
            if not out:
                raise
            self.error = e
            return out

    def messages(self, buf: bytes | bytearray, end: int, key: bytes | None = None,
                 dst: int = -1) -> list[Message | None]:
        """Add ``buf[:end]``; return the group messages now complete, decoded
        (:func:`decode`), with ``None`` for each malformed or unauthenticated one. Framing
        errors as :meth:`feed`. (``buf`` is a receive buffer: nothing returned refers to it.)

        The same as ``[decode_or_none(f, key, dst) for f in feed(buf[:end])]``, in one pass for
        the usual case: whole usual messages (header, payload, MAC). A message that a read
        cuts (every full read of a stream of small messages ends inside one) is kept, and the
        next read completes it the general way, then goes on in one pass; anything unusual
        goes the general way from where it starts."""
        if key is None or self.error is not None:
            with memoryview(buf) as view:
                return [decode_or_none(f, key, dst) for f in self.feed(view[:end])]
        pos = 0
        out: list[Message | None] = []
        if self.buf:  # a message begun in an earlier read: what completes it, the general way
            pos = self._rest_of_carried(buf, end)
            with memoryview(buf) as view:
                out = [decode_or_none(f, key, dst) for f in self.feed(view[:pos])]
            if pos == end or self.error is not None or self.buf:
                return out
        hmax = self.max_message - HEADER.size - MAC_SIZE
        to = _to(dst)
        fresh = _hash(key).copy
        same = hmac.compare_digest
        while end - pos >= _FSIZE:
            lead, b, ml, mv, kind, op, codec, flags, src, gid, seq, rnd, root, nbuf = \
                _FASTR.unpack_from(buf, pos)
            p = pos + _FSIZE
            q = p + b
            nxt = q + MAC_SIZE
            if nxt > end or lead != _LEAD or ml != _MAC_LEN or b > hmax or mv != _MV \
                    or kind not in KINDS or codec not in CODECS or flags != FLAG_MAC or nbuf:
                break  # cut by the read, or not the usual message: the general way
            h = fresh()  # (_mac_state's input: the message's stream bytes but its MAC)
            h.update(buf[pos:q])
            h.update(to)
            if same(h.digest(), buf[q:nxt]):
                payload = buf[p:q]  # (a copy)
                # tuple.__new__: a Message without its Python-level __new__ (one per message)
                out.append(_new_tuple(Message, (kind, src, gid, seq, rnd, op, root, codec,
                                                payload, ())))
            else:
                out.append(None)  # (or one made for another rank)
            pos = nxt
        if pos == end:
            return out
        with memoryview(buf) as view:  # the rest, from a message's start
            try:
                rest = self.feed(view[pos:end])
            except WireError as e:  # (as feed: messages before it are returned, it is kept)
                if not out:
                    raise
                self.error = e
                return out
        out += [decode_or_none(f, key, dst) for f in rest]
        return out

    def _rest_of_carried(self, buf: bytes | bytearray, end: int) -> int:
        """How many bytes of ``buf[:end]`` complete the message begun in :attr:`buf`; ``end``
        where they do not, or where its prefix is not the usual (the general way then takes
        the whole read, and says what is wrong)."""
        have = len(self.buf)
        if self._lens is not None:
            total = self._head + sum(self._lens)
        else:  # (its prefix incomplete: it ends in this read, or the message is malformed)
            with memoryview(buf) as view:
                head = bytes(self.buf) + bytes(view[:min(end, _PREFIX_MAX)])
            if len(head) < STREAM_HEAD.size:
                return end
            magic, n = STREAM_HEAD.unpack_from(head)
            need = STREAM_HEAD.size + 8 * n
            if magic != STREAM_MAGIC or not 1 <= n <= MAX_FRAMES or len(head) < need:
                return end
            total = need + sum(struct.unpack_from(f"<{n}Q", head, STREAM_HEAD.size))
        return min(max(total - have, 0), end)

    def _whole(self, data: bytes | memoryview) -> list[list[bytes]] | None:
        """Messages straight from ``data`` when it holds whole, well-formed messages only
        (the common case for small messages); None to take the general path."""
        view = memoryview(data)
        end = view.nbytes
        pos = 0
        out = []
        p3 = _USUAL
        while pos < end:
            if end - pos < STREAM_HEAD.size:
                return None
            if end - pos >= p3.size:  # the usual message: header, payload and MAC
                magic, n, a, b, c = p3.unpack_from(view, pos)
                if magic == STREAM_MAGIC and n == 3:
                    p = pos + p3.size
                    if p + a + b + c > end or a + b + c > self.max_message:
                        return None
                    header = bytes(view[p : p + a])
                    out.append([header, bytes(view[p + a : p + a + b]),
                                _buffer_type(header)(view[p + a + b : p + a + b + c])])
                    pos = p + a + b + c
                    continue
            magic, n = STREAM_HEAD.unpack_from(view, pos)
            if magic != STREAM_MAGIC or not 1 <= n <= MAX_FRAMES:
                return None
            st = _PREFIX.get(n)
            if st is None or end - pos < st.size:
                return None
            lens = st.unpack_from(view, pos)[2:]
            p = pos + st.size
            if p + sum(lens) > end or sum(lens) > self.max_message:
                return None
            frames: list[bytes] = []
            make: type = bytes
            for i, ln in enumerate(lens):  # (out-of-band buffers writable: _buffer_type)
                frames.append(make(view[p : p + ln]))
                if i == 1:
                    make = _buffer_type(frames[0])
                p += ln
            out.append(frames)
            pos = p
        return out

    def _parse(self, out: list[list[bytes]]) -> list[list[bytes]]:
        buf = self.buf
        pos = 0
        while True:
            if self._lens is None:
                if len(buf) - pos < STREAM_HEAD.size:
                    break
                magic, n = STREAM_HEAD.unpack_from(buf, pos)
                if magic != STREAM_MAGIC:
                    raise WireError("bad stream magic")
                if not 1 <= n <= MAX_FRAMES:
                    raise WireError(f"bad frame count {n}")
                need = STREAM_HEAD.size + 8 * n
                if len(buf) - pos < need:
                    break
                lens = struct.unpack_from(f"<{n}Q", buf, pos + STREAM_HEAD.size)
                if sum(lens) > self.max_message:
                    raise WireError(f"message of {sum(lens)} bytes exceeds the limit")
                self._lens, self._head = lens, need
            total = self._head + sum(self._lens)
            if len(buf) - pos < total:
                break
            p = pos + self._head
            frames: list[bytes] = []
            with memoryview(buf) as view:  # a slice of the view: one copy, not two
                make: type = bytes
                for i, ln in enumerate(self._lens):  # (buffers writable, as in _whole)
                    frames.append(make(view[p : p + ln]))
                    if i == 1:
                        make = _buffer_type(frames[0])
                    p += ln
            out.append(frames)
            pos += total
            self._lens = None
        if pos:
            del buf[:pos]
        return out

    def pending(self) -> int:
        """Bytes buffered toward an incomplete message."""
        return len(self.buf)
