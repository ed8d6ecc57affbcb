"""The pure framing module: round trips, and any garbage decodes or raises WireError only."""

import pickle
import struct
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctrlcomm import _wire as w
from ctrlcomm._errors import CodecError, WireError

KEY = b"k" * 32


def msg(**kw):
    base = dict(kind=w.COLL, src=3, group_id=0xABCDEF, seq=12, round=2, op=7, root=1,
                codec=w.PICKLE, payload=pickle.dumps({"a": 1}), buffers=())
    base.update(kw)
    return w.Message(**base)


@pytest.mark.parametrize("key", [None, KEY])
def test_round_trip(key):
    m = msg()
    assert w.decode(w.encode(m, key), key) == m


def test_large_buffers_travel_out_of_band():
    big = bytearray(range(256)) * 1024  # 256 KiB
    payload, bufs = w.dumps({"x": big, "small": b"abc"}, w.PICKLE)
    assert len(bufs) == 1 and memoryview(bufs[0]).nbytes == len(big)
    assert len(payload) < 1000
    frames = w.encode(msg(payload=payload, buffers=bufs))
    m = w.decode([bytes(f) for f in frames])
    assert w.loads(m.payload, m.buffers, m.codec) == {"x": big, "small": b"abc"}


def test_large_array_is_never_copied_in_band():
    # a numpy array pickles through a PickleBuffer: it must go out of band without first
    # being copied into a pickle stream (8 MiB array: the encoder's peak memory stays small)
    np = pytest.importorskip("numpy")
    arr = np.arange(1 << 20, dtype=np.int64)
    nested = {"a": arr, "n": 1}
    for obj in (arr, nested):
        tracemalloc.start()
        try:
            payload, bufs = w.dumps(obj, w.PICKLE)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert len(bufs) == 1 and memoryview(bufs[0]).nbytes == arr.nbytes
        assert peak < 1 << 20, peak
        got = w.loads(payload, tuple(bytes(b) for b in bufs), w.PICKLE)
        assert (got["a"] if isinstance(got, dict) else got).tolist() == arr.tolist()


def test_small_buffers_stay_in_band():
    payload, bufs = w.dumps(b"x" * 100, w.PICKLE)
    assert bufs == ()


def test_unpicklable_raises_codec_error():
    with pytest.raises(CodecError, match="lambda|pickle"):
        w.dumps(lambda: 1, w.PICKLE)


def test_a_mac_is_good_at_the_rank_it_was_made_for_only():
    m = msg(payload=b"p" * 100, buffers=(b"b" * 70000,))
    for dst in (0, 1, 5):
        frames = w.encode(m, KEY, dst)
        assert w.decode(frames, KEY, dst) == m
        for other in {-1, 0, 1, 5, 2**31} - {dst}:
            with pytest.raises(WireError, match="bad MAC"):
                w.decode(frames, KEY, other)
    # one message for several ranks, hashed once: the same frames as made one by one
    dsts = [4, 0, 2]
    each = w.frames_for(dsts, *m[:-1], m.buffers, KEY)
    assert each == [w.encode(m, KEY, d) for d in dsts]
    assert [w.decode(f, KEY, d) for f, d in zip(each, dsts, strict=True)] == [m] * 3


def test_mac_rejects_tampering_and_wrong_key():
    frames = w.encode(msg(), KEY)
    for i in range(len(frames)):
        bad = [bytearray(f) for f in frames]
        bad[i][len(bad[i]) // 2] ^= 1
        with pytest.raises(WireError):
            w.decode([bytes(f) for f in bad], KEY)
    with pytest.raises(WireError):
        w.decode(frames, b"other key")
    with pytest.raises(WireError):
        w.decode(w.encode(msg()), KEY)  # unauthenticated frame into an authenticated group


def test_other_version_and_kinds_rejected():
    frames = w.encode(msg())
    head = bytearray(frames[0])
    head[2] = 99
    with pytest.raises(WireError, match="version"):
        w.decode([bytes(head), *frames[1:]])
    head = bytearray(frames[0])
    head[3] = 200
    with pytest.raises(WireError, match="kind"):
        w.decode([bytes(head), *frames[1:]])


@given(st.lists(st.binary(max_size=80), max_size=6))
def test_decode_garbage_frames(frames):
    try:
        w.decode(frames)
    except WireError:
        pass


@given(st.binary(max_size=60), st.lists(st.binary(max_size=20), max_size=4))
def test_decode_garbage_after_valid_header(tail, extra):
    frames = w.encode(msg())
    try:
        w.decode([frames[0][: len(tail) % (w.HEADER.size + 1)] + tail, *extra])
    except WireError:
        pass


def _stream(frames_list):
    out = b""
    for frames in frames_list:
        out += w.stream_prefix(frames) + b"".join(bytes(f) for f in frames)
    return out


@given(st.lists(st.lists(st.binary(max_size=50), min_size=1, max_size=4), max_size=5),
       st.integers(1, 17))
def test_stream_decoder_any_split(messages, chunk):
    data = _stream(messages)
    d = w.StreamDecoder()
    got = []
    for i in range(0, len(data), chunk):
        got += d.feed(data[i : i + chunk])
    assert got == messages
    assert d.pending() == 0


@given(st.binary(max_size=300))
def test_stream_decoder_garbage(data):
    d = w.StreamDecoder()
    try:
        for i in range(0, len(data), 7):
            d.feed(data[i : i + 7])
    except WireError:
        pass


def test_stream_decoder_refuses_huge_length_without_buffering():
    d = w.StreamDecoder()
    with pytest.raises(WireError, match="exceeds"):
        d.feed(w.STREAM_HEAD.pack(w.STREAM_MAGIC, 1) + struct.pack("<Q", 1 << 60))


def test_stream_decoder_trailing_partial_kept():
    frames = [b"abc", b"defg"]
    data = _stream([frames]) + b"CF"
    d = w.StreamDecoder()
    assert d.feed(data) == [frames]
    assert d.pending() == 2


def test_store_protocol_round_trip():
    req = w.StoreRequest(w.S_CAS, 7, 1.5, (b"k",), (b"1", b"", b"v"))
    assert w.decode_store_request(w.encode_store_request(req)) == req
    rep = w.StoreReply(w.R_OK, 7, (b"v",))
    assert w.decode_store_reply(w.encode_store_reply(rep)) == rep


@given(st.lists(st.binary(max_size=40), max_size=5))
def test_store_decoders_garbage(frames):
    for dec in (w.decode_store_request, w.decode_store_reply):
        try:
            dec(frames)
        except WireError:
            pass


def test_store_request_nan_timeout_rejected():
    frames = w.encode_store_request(w.StoreRequest(w.S_GET, 1, 0.0, (b"k",)))
    head = bytearray(frames[0])
    struct.pack_into("<d", head, 8, float("nan"))
    with pytest.raises(WireError):
        w.decode_store_request([bytes(head), *frames[1:]])


def test_msgpack_codec_keeps_tuples_and_refuses_objects():
    obj = {"a": (1, 2, [3, (4,)]), "b": b"raw", "c": None, "big": 2**63 - 1}
    payload, bufs = w.dumps(obj, w.MSGPACK)
    assert w.loads(payload, bufs, w.MSGPACK) == obj
    with pytest.raises(CodecError, match="msgpack"):
        w.dumps(object(), w.MSGPACK)
    for v in (2**64 - 1, -(2**63)):  # (its range)
        assert w.loads(*w.dumps(v, w.MSGPACK), w.MSGPACK) == v
    # an int beyond it is named as such (it said "cannot encode an object of type int")
    for v, shown in ((2**64, f"int {2**64}"), (-(2**63) - 1, f"int {-(2**63) - 1}"),
                     ([1, 2**300], "int of 301 bits")):
        with pytest.raises(CodecError, match=f"the {shown} is out of msgpack's range"):
            w.dumps(v, w.MSGPACK)
    import enum

    class Color(enum.IntEnum):
        RED = 1

    with pytest.raises(CodecError, match="cannot encode an object of type Color"):
        w.dumps({"k": Color.RED}, w.MSGPACK)  # (a subclass of int: its type, not a range)


@pytest.mark.parametrize("codec", [w.PICKLE, w.MSGPACK])
def test_a_failure_travels_with_the_ranks_it_names(codec):
    import msgpack

    from ctrlcomm import _msgpack, _ops

    for f in (_ops.Failed("ValueError: x", "reduction", ((0, 1), (2,))),
              _ops.Failed("on rank 3: no", "operand")):
        back = w.loads(*w.dumps(f, codec), codec)
        assert (back.message, back.kind, back.sides) == (f.message, f.kind, f.sides)
    # from a peer of an earlier version (two fields), or sides that are not two lists of ints:
    # none named, never an error while decoding
    for fields in (["m", "reduction"], ["m", "reduction", [[0], ["1"]]], ["m", "reduction", 7],
                   ["m", "reduction", [[0], [1], [2]]], ["m", "reduction", [[0], 1]],
                   ["m", "reduction", [[], []]], ["m", "reduction", [[0], [-1]]]):
        data = msgpack.packb(msgpack.ExtType(_msgpack._FAILED, msgpack.packb(fields)))
        back = _msgpack.loads(data)
        assert (back.message, back.sides) == ("m", ())


def test_good_messages_before_garbage_are_kept():
    frames = [b"abc", b"de"]
    d = w.StreamDecoder()
    assert d.feed(_stream([frames]) + b"XXXXXXXX") == [frames]
    assert isinstance(d.error, WireError)
    with pytest.raises(WireError):
        d.feed(b"more")


def test_large_bytes_alone_go_out_of_band_and_load_without_a_copy():
    big = bytes(range(256)) * 4096  # 1 MiB
    payload, bufs = w.dumps(big, w.PICKLE)
    assert len(payload) < 100 and len(bufs) == 1 and memoryview(bufs[0]).nbytes == len(big)
    frame = bytes(bufs[0])  # what the receiver's decoder hands over
    got = w.loads(payload, (frame,), w.PICKLE)
    assert got == big and got is frame  # the frame itself: no second copy
    payload, bufs = w.dumps(bytearray(big), w.PICKLE)
    got = w.loads(payload, (bytes(bufs[0]),), w.PICKLE)
    assert type(got) is bytearray and got == big
    frame = bytearray(bufs[0])
    assert w.loads(payload, (frame,), w.PICKLE) is frame


def _through_a_stream(msg, key=None, split=None):
    """The message as the receiving rank's stream decoder and decode() hand it over (whole,
    or in two reads split at ``split``: the decoder's other path)."""
    frames = w.encode(msg, key, 3)
    data = bytes(w.stream_prefix(frames)) + b"".join(bytes(f) for f in frames)
    d = w.StreamDecoder()
    if split is None:
        (got,) = d.feed(data)
    else:
        assert d.feed(data[:split]) == []
        (got,) = d.feed(data[split:])
    return got, w.decode(got, key, 3)


@pytest.mark.parametrize("split", [None, 7, 100])
@pytest.mark.parametrize("key", [None, b"k"])
def test_received_buffers_are_bytes_only_where_all_were_immutable(key, split):
    # a message whose out-of-band buffers are all bytes says so (FLAG_IMMUTABLE): they arrive
    # as bytes (a large bytes object is unpickled onto its frame); any other arrives as
    # writable bytearrays, over a stream (the decoder makes them so) or another transport
    big = b"b" * w.OOB_THRESHOLD
    for obj, immutable in ((big, True), ({"x": big, "y": big * 2}, True),
                           (bytearray(big), False), ({"x": big, "y": bytearray(big)}, False)):
        payload, bufs = w.dumps(obj, w.PICKLE)
        msg = w.Message(w.P2P, 1, 7, 0, 0, 0, w.NO_ROOT, w.PICKLE, payload, tuple(bufs))
        frames, m = _through_a_stream(msg, key, split)
        assert bool(frames[0][6] & w.FLAG_IMMUTABLE) is immutable
        assert {type(b) for b in m.buffers} == {bytes if immutable else bytearray}
        assert w.loads(m.payload, m.buffers, m.codec) == obj
        other = w.decode([bytes(f) for f in frames], key, 3)  # (as ZeroMQ hands them over)
        assert {type(b) for b in other.buffers} == {bytes if immutable else bytearray}
    plain = w.encode(w.Message(w.P2P, 1, 7, 0, 0, 0, w.NO_ROOT, w.PICKLE, b"p"))
    assert plain[0][6] == 0
    flagged = [plain[0][:6] + bytes([w.FLAG_IMMUTABLE]) + plain[0][7:], plain[1]]
    with pytest.raises(WireError, match="without buffers"):
        w.decode(flagged)


def test_a_large_array_arrives_writable_and_its_own():
    np = pytest.importorskip("numpy")
    arr = np.arange(1 << 14, dtype=np.int64)  # 128 KiB: out of band
    payload, bufs = w.dumps({"a": arr}, w.PICKLE)
    assert len(bufs) == 1
    msg = w.Message(w.COLL, 1, 7, 0, 0, 0, w.NO_ROOT, w.PICKLE, payload, tuple(bufs))
    for _frames, m in (_through_a_stream(msg), _through_a_stream(msg, b"k"),
                       _through_a_stream(msg, None, 50)):
        got = w.loads(m.payload, m.buffers, m.codec)["a"]
        assert got.flags.writeable and got.tolist() == arr.tolist()
        got += 1
        assert arr[0] == 0 and got[0] == 1


def _group_msg(draw_kind, src, seq, payload, key=b"k", dst=-1):
    return w.encode(w.Message(draw_kind, src, 77, seq, 0, 1, w.NO_ROOT, w.PICKLE, payload),
                    key, dst)


_USUAL = _group_msg(w.COLL, 1, 3, b"")
_HEAD = _USUAL[0]
_frames = st.one_of(
    # the usual message (header, payload, MAC), well formed; or made for another rank
    st.builds(_group_msg, st.sampled_from(sorted(w.KINDS)), st.integers(0, 9),
              st.integers(0, 2**40), st.binary(max_size=30)),
    st.builds(lambda p: _group_msg(w.COLL, 1, 3, p, dst=5), st.binary(max_size=10)),
    # with out-of-band buffers, another key, none, or garbage frames
    st.builds(lambda p, b: w.encode(w.Message(w.COLL, 1, 77, 3, 0, 1, w.NO_ROOT, w.PICKLE, p,
                                              (b,)), b"k"), st.binary(max_size=10),
              st.binary(max_size=10)),
    st.builds(lambda p: _group_msg(w.P2P, 2, 1, p, key=b"other"), st.binary(max_size=10)),
    st.builds(lambda p: _group_msg(w.P2P, 2, 1, p, key=None), st.binary(max_size=10)),
    st.lists(st.binary(max_size=60), min_size=1, max_size=3),
    # a header with one byte changed (magic, version, kind, codec, flags, counts...), or
    # the payload, or the MAC
    st.builds(lambda i, v: [_HEAD[:i] + bytes([v]) + _HEAD[i + 1:], *_USUAL[1:]],
              st.integers(0, w.HEADER.size - 1), st.integers(0, 255)),
    st.builds(lambda p: [_HEAD, p, _USUAL[2]], st.binary(min_size=1, max_size=5)),
    st.builds(lambda m: [_HEAD, _USUAL[1], m], st.binary(min_size=16, max_size=16)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_frames, max_size=5), st.one_of(st.just(1 << 20), st.integers(1, 200)),
       st.sampled_from([None, b"k", b"k"]))
def test_messages_equals_feed_then_decode(frames_list, chunk, key):
    # the one-pass path of messages() gives what framing then decode() give, whatever the
    # split of the stream into reads, garbage included
    data = _stream(frames_list)
    fast, slow = w.StreamDecoder(), w.StreamDecoder()
    buf = bytearray(len(data))  # the receive buffer, reused for every read
    got, want = [], []
    fast_err = slow_err = None
    for i in range(0, len(data), chunk):
        part = data[i : i + chunk]
        buf[: len(part)] = part
        if fast_err is None:
            try:
                got += fast.messages(buf, len(part), key)
            except WireError as e:
                fast_err = e
        if slow_err is None:
            try:
                want += [w.decode_or_none(f, key) for f in slow.feed(part)]
            except WireError as e:
                slow_err = e
    assert got == want
    assert (fast_err is None) == (slow_err is None)


def test_messages_one_pass_checks_the_header_and_mac_as_decode_does():
    good = _group_msg(w.COLL, 1, 5, b"payload")
    for i in range(2, w.HEADER.size):  # version, kind, op, codec, flags, src, ...
        for v in (0, 2, 0x7F, 0xFF):
            frames = [_HEAD[:i] + bytes([v]) + _HEAD[i + 1:], *_USUAL[1:]]
            data = bytearray(_stream([good, frames, good]))
            want = [w.decode_or_none(f, b"k") for f in w.StreamDecoder().feed(data)]
            assert w.StreamDecoder().messages(data, len(data), b"k") == want
            assert want[0] is not None and want[2] is not None


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(w.KINDS)), st.integers(0, 2**31 - 1), st.integers(0, 2**64 - 1),
       st.integers(0, 2**64 - 1), st.integers(-(2**63), 2**63 - 1), st.integers(0, 255),
       st.integers(-(2**31), 2**31 - 1), st.sampled_from(sorted(w.CODECS)),
       st.binary(max_size=100))
def test_stream_messages_are_the_framing_of_their_frames(kind, src, gid, seq, rnd, op, root,
                                                         codec, payload):
    # the one-piece framing of the usual message, for each destination: the same bytes as
    # the prefix and frames (each its MAC) joined, and it decodes back (both ways, at its
    # destination only) to the message it was built from
    dsts = [0, 3, 7]
    each = w.frames_for(dsts, kind, src, gid, seq, rnd, op, root, codec, payload, (), b"k")
    datas = w.stream_messages(dsts, kind, src, gid, seq, rnd, op, root, codec, payload, b"k")
    want = w.Message(kind, src, gid, seq, rnd, op, root, codec, payload)
    for d, frames, data in zip(dsts, each, datas, strict=True):
        assert data == w.stream_prefix(frames) + b"".join(frames)
        assert w.StreamDecoder().messages(bytearray(data), len(data), b"k", d) == [want]
        assert [w.decode(f, b"k", d) for f in w.StreamDecoder().feed(data)] == [want]
        assert w.StreamDecoder().messages(bytearray(data), len(data), b"k", d + 1) == [None]


def test_messages_takes_a_cut_stream_in_one_pass(monkeypatch):
    # every full read of a stream of small messages ends inside one: the message cut is
    # completed by the next read the general way, and the rest of that read still goes the
    # one-pass way (before: each such read went the general way whole, 3x slower per message)
    data = b"".join(w.stream_messages([2], w.P2P, 1, 7, i + 1, 0, 0, w.NO_ROOT, w.PICKLE,
                                      pickle.dumps(i), b"k")[0] for i in range(1000))
    general = []
    decode_or_none = w.decode_or_none
    monkeypatch.setattr(w, "decode_or_none", lambda *a: general.append(1) or decode_or_none(*a))
    dec, buf, got = w.StreamDecoder(), bytearray(1000), []
    for i in range(0, len(data), 1000):
        part = data[i : i + 1000]
        buf[: len(part)] = part
        got += dec.messages(buf, len(part), b"k", 2)
    assert [pickle.loads(m.payload) for m in got] == list(range(1000))
    assert [m.seq for m in got] == list(range(1, 1001))
    assert len(general) <= len(data) // 1000 + 1  # one per read: the message it cut


# ------------------------------------------------------------------ the store's stream


def _store_stream(msgs):
    return b"".join(w.store_stream_message(m) for m in msgs)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.binary(max_size=40), min_size=1, max_size=6), max_size=5),
       st.integers(1, 64))
def test_store_stream_any_split(msgs, chunk):
    data = _store_stream(msgs)
    dec, got = w.StoreStreamDecoder(8, 1000), []
    for i in range(0, len(data), chunk):
        got += dec.feed(data[i : i + chunk])
    assert got == msgs and dec.pending() == 0


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(1, 50))
def test_store_stream_garbage_decodes_or_raises_wire_error(data, chunk):
    # whole, byte by byte, or in chunks: messages, or WireError (then for every later feed)
    for step in (len(data) or 1, 1, chunk):
        dec = w.StoreStreamDecoder(4, 200)
        try:
            for i in range(0, len(data), step):
                for frames in dec.feed(data[i : i + step]):
                    assert 1 <= len(frames) <= 4 and sum(map(len, frames)) <= 200
        except WireError:
            with pytest.raises(WireError):
                dec.feed(b"CQ")


@settings(max_examples=100, deadline=None)
@given(st.integers(5, 100_000), st.integers(201, 1 << 30))
def test_the_store_stream_refuses_a_message_past_its_limits_from_its_prefix(n, size):
    # 4 M empty frames, or a frame declared huge: refused as the prefix says so, nothing
    # buffered toward it
    for prefix in (struct.pack("<2sI", b"CQ", n), struct.pack("<2sII", b"CQ", 1, size)):
        dec = w.StoreStreamDecoder(4, 200)
        with pytest.raises(WireError, match="at most"):
            dec.feed(prefix)
        assert dec.pending() <= len(prefix)


def test_a_store_hello_names_its_client():
    cid = bytes(range(16))
    [frames] = w.StoreStreamDecoder(4, 100).feed(w.store_hello(cid))
    assert w.store_hello_id(frames) == cid
    for bad in ([w.STORE_HELLO], [w.STORE_HELLO, b"short"], [b"other", cid]):
        with pytest.raises(WireError):
            w.store_hello_id(bad)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.binary(max_size=60), min_size=1, max_size=5), max_size=6),
       st.integers(0, 70), st.integers(1, 50))
def test_the_store_stream_drops_a_message_larger_than_its_room_as_it_comes(msgs, room, chunk):
    # what does not fit is returned as Skipped (its first frame, where small), never
    # buffered; the messages around it are decoded as ever, whatever the reads' split
    data = _store_stream(msgs)
    dec, got = w.StoreStreamDecoder(8, 1000, lambda: room), []
    for i in range(0, len(data), chunk):
        got += dec.feed(data[i : i + chunk])
        assert dec.pending() <= 6 + 4 * 8 + max(room, 60)
    want = [m if max(map(len, m)) <= room
            else w.Skipped(m[0] if len(m[0]) <= w.SKIP_KEEP else b"", max(map(len, m)))
            for m in msgs]
    assert got == want


# --------------------------------------------------------------------- control payloads

_OWN_TEXT = st.text(max_size=40).filter(lambda t: not t.startswith(("\x00lost:", "\x00mismatch:")))


@given(st.one_of(
    st.builds(w.AbortReason, st.just(w.ABORT_OWN), _OWN_TEXT, st.just(())),
    st.builds(w.AbortReason, st.just(w.ABORT_MISMATCH), st.text(max_size=40), st.just(())),
    st.builds(w.AbortReason, st.just(w.ABORT_LOST), st.text(max_size=40),
              st.lists(st.integers(0, 10**6), max_size=5).map(tuple))))
def test_an_abort_reason_reads_back_as_it_was_said(reason):
    assert w.decode_abort(reason.encode()) == reason


@given(st.binary(max_size=120))
def test_any_abort_payload_reads_as_some_reason(data):
    got = w.decode_abort(data)
    assert got.kind in (w.ABORT_OWN, w.ABORT_LOST, w.ABORT_MISMATCH)
    assert isinstance(got.text, str) and all(type(r) is int and r >= 0 for r in got.ranks)
    if got.kind == w.ABORT_OWN:
        assert got.text == data.decode(errors="replace")


def test_an_abort_of_earlier_releases_reads_the_same():
    """(What a peer of the same wire version sends: the marks are part of the format.)"""
    assert w.decode_abort(b"\x00lost:1,x,2|rank 1 is gone") == \
        w.AbortReason(w.ABORT_LOST, "rank 1 is gone", (1, 2))
    assert w.decode_abort(b"\x00mismatch:#3 differs") == w.AbortReason(w.ABORT_MISMATCH, "#3 differs")
    assert w.decode_abort(b"watchdog") == w.AbortReason(w.ABORT_OWN, "watchdog")


@given(st.one_of(
    st.builds(w.Status, st.sampled_from([w.STATUS_IN_CALL, w.STATUS_RETURNED]),
              st.integers(0, 2**63 - 1), st.integers(0, 255), st.integers(-1, 2**31 - 1),
              st.text(max_size=60)),
    st.builds(w.Status, st.just(0), st.just(0), st.just(0), st.just(w.NO_ROOT),
              st.text(max_size=60))),
    st.integers(0, 1000), st.integers(0, 2**63 - 1))
def test_a_status_reads_back_as_it_was_said_through_the_whole_message(st_, src, gid):
    """A STATUS_REP as it travels: its numbers in the header, its words the payload, MACed
    (the wire's encode and decode) and read back as the same status."""
    m = w.Message(w.STATUS_REP, src, gid, st_.seq, st_.where, st_.op, st_.root, w.RAW,
                  st_.encode())
    got = w.decode(w.encode(m, key=b"k" * 32, dst=3), b"k" * 32, 3)
    assert w.decode_status(got) == st_


@given(st.integers(-2**31, 2**31 - 1), st.integers(0, 2**63 - 1), st.binary(max_size=80))
def test_any_status_reply_reads_as_some_status(where, seq, payload):
    m = w.Message(w.STATUS_REP, 1, 1, seq, where, 3, 0, w.RAW, payload)
    got = w.decode_status(m)
    assert got.where in (0, w.STATUS_IN_CALL, w.STATUS_RETURNED)
    assert got.text == w.said(payload) == payload.decode(errors="replace")
    if not got.where:
        assert (got.seq, got.op, got.root) == (0, 0, w.NO_ROOT)


_FIELD = st.from_regex(r"\A[a-z]{1,6}:[!-~]{0,12}\Z")


@given(st.from_regex(r"\Atcp://[!-~]{1,20}\Z"), st.integers(0, 65535),
       st.lists(_FIELD, max_size=8).map(tuple))
def test_an_address_record_reads_back_as_it_was_written(endpoint, port, fields):
    rec = w.AddressRecord(endpoint, port, fields)
    assert w.decode_address(rec.encode()) == rec


@given(st.text(max_size=120))
def test_any_address_line_decodes_or_raises_wire_error(text):
    try:
        rec = w.decode_address(text)
    except WireError:
        return
    assert rec.encode() == text and 0 <= rec.udp_port <= 65535


def test_an_address_record_names_its_fields():
    rec = w.decode_address("tcp://10.0.0.1:5000 6000 unix:x@h proc:k:1:2 ws:4 codec:pickle "
                           "tr:tcp wire:4 join:ab12 later:field")
    assert (rec.endpoint, rec.udp_port) == ("tcp://10.0.0.1:5000", 6000)
    assert rec.named("proc") == ["proc:k:1:2"] and rec.named("join") == ["join:ab12"] \
        and rec.named("no") == []
    assert rec.named("unix", "curve") == ["unix:x@h"]
    assert rec.alike() == {"ws": "4", "codec": "pickle", "tr": "tcp", "wire": "4"}
    for bad in ("", "tcp://h:1", "tcp://h:1 port", "tcp://h:1 70000", "tcp://h:1 5 novalue",
                "tcp://h:1 5  ws:2"):
        with pytest.raises(WireError):
            w.decode_address(bad)


@given(st.binary(max_size=200), st.integers(0, 3), st.binary(max_size=40))
def test_the_usual_message_expected_is_found_only_where_it_is(payload, dst, tail):
    key = b"k" * 32
    one, = w.stream_messages([dst], w.COLL, 2, 77, 5, 1, 0x21, w.NO_ROOT, w.PICKLE, payload, key)
    head = w.usual_header(w.COLL, 0x21, 2, 77, 5, 1, w.NO_ROOT)
    buf = bytearray(one + tail)
    end = w.usual_expected(buf, len(buf), head, key, dst)
    assert end == len(one) and bytes(buf[w.EXPRESS_SIZE:end - w.MAC_SIZE]) == payload
    # another call's, or another rank's MAC, or a read cut before its end: not it
    other = w.usual_header(w.COLL, 0x21, 2, 77, 6, 1, w.NO_ROOT)
    assert w.usual_expected(buf, len(buf), other, key, dst) == 0
    assert w.usual_expected(buf, len(buf), head, key, dst + 1) == 0
    assert w.usual_expected(buf, len(one) - 1, head, key, dst) == 0


@given(st.binary(max_size=300))
def test_no_garbage_is_taken_for_the_usual_message(data):
    head = w.usual_header(w.COLL, 1, 0, 1, 0, 0, w.NO_ROOT)
    assert w.usual_expected(bytearray(data), len(data), head, b"k" * 32, 0) == 0
