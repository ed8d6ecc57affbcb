"""The TCP endpoint's straight sends, and the core's framing of the usual message."""

import pickle
import socket
import struct
import threading
import time

import pytest

from ctrlcomm import _wire as w
from ctrlcomm._core import Core
from ctrlcomm.testing._standin import StandInEndpoint
from ctrlcomm.transport._tcp import TcpEndpoint


def test_sends_queued_behind_a_full_socket_keep_their_order_and_go_straight_again(monkeypatch):
    """A peer that does not read fills the kernel's buffers: what follows is queued, and
    nothing may overtake it (a send straight to the socket while data waits in the queue
    would interleave two messages' bytes). Once the queue has drained, sends go straight to
    the socket again."""
    monkeypatch.setenv("CTRLCOMM_LOCAL_SOCKETS", "0")  # plain TCP
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    ep = TcpEndpoint("127.0.0.1")
    size, count = 16 * 1024, 400  # 6.4 MiB: more than loopback's buffers hold
    peer = None
    # (held as a group's calls hold it: the endpoint's thread that sends what a call left
    # queued takes it too, and sends only while no call runs)
    ep.io.acquire()
    try:
        ep.set_peers({1: f"tcp://127.0.0.1:{srv.getsockname()[1]}"})
        ep.send_framed([1], [struct.pack("<I", 0) + b"x" * (size - 4)])
        peer, _ = srv.accept()
        deadline = time.monotonic() + 10
        while ep.unflushed and time.monotonic() < deadline:  # connected, first one sent
            ep.wait(0.05)
            ep.drain(lambda m: None)
        assert 1 in ep.direct
        for i in range(1, count):
            ep.send_framed([1], [struct.pack("<I", i) + b"x" * (size - 4)])
        assert ep.unflushed and 1 not in ep.direct  # the kernel took only part of it

        got = bytearray()

        def read() -> None:
            peer.settimeout(10)
            while len(got) < (count + 1) * size:
                data = peer.recv(1 << 20)
                if not data:
                    return
                got.extend(data)

        reader = threading.Thread(target=read)
        reader.start()
        while ep.unflushed and time.monotonic() < deadline:
            ep.wait(0.05)
            ep.drain(lambda m: None)
        assert not ep.unflushed and 1 in ep.direct  # drained: straight sends again
        ep.send_framed([1], [struct.pack("<I", count) + b"x" * (size - 4)])
        reader.join(10)
        assert not reader.is_alive()
        assert [struct.unpack_from("<I", got, i * size)[0] for i in range(count + 1)] \
            == list(range(count + 1))
    finally:
        ep.close()
        ep.io.release()
        srv.close()
        if peer is not None:
            peer.close()


class Capture(StandInEndpoint):
    """An endpoint that keeps what is sent (the core's framing, without sockets)."""

    def __init__(self) -> None:
        super().__init__()
        self.framed: list[tuple[list[int], bytes]] = []
        self.many: list[tuple[list[int], list[bytes]]] = []
        self.signed: list[tuple[int, list[bytes]]] = []

    def send_framed(self, dsts, data):
        self.framed += [([d], bytes(one)) for d, one in zip(dsts, data, strict=True)]

    def send_many(self, dsts, frames):
        self.many.append((list(dsts), [bytes(memoryview(f)) for f in frames]))

    def send(self, dst, frames):
        self.signed.append((dst, [bytes(memoryview(f)) for f in frames]))


K = b"k" * 32


def _core(ep, key=K, codec=w.PICKLE):
    return Core(name="t", rank=1, size=4, group_id=99, endpoint=ep, codec=codec, key=key,
                timeout=5.0)


@pytest.mark.parametrize("obj", [None, 7, (1, 2), {"a": 1, "b": "x" * 100}, b"y" * 60000])
def test_the_usual_message_is_framed_in_one_piece_as_stream_messages_frames_it(obj):
    ep = Capture()
    core = _core(ep)
    core._post(((0, obj),), 3, 12, 0x21, w.NO_ROOT)  # one destination
    core._post(((0, obj), (2, obj), (3, obj)), 0, 13, 5, 2)  # one object to three
    payload = pickle.dumps(obj, 5)
    one = w.stream_messages([0], w.COLL, 1, 99, 12, 3, 0x21, w.NO_ROOT, w.PICKLE, payload, K)
    three = w.stream_messages([0, 2, 3], w.COLL, 1, 99, 13, 0, 5, 2, w.PICKLE, payload, K)
    assert ep.framed == [([0], one[0])] + [([d], x) for d, x in zip([0, 2, 3], three,
                                                                      strict=True)]
    assert core.sent == 4
    for [d], data in ep.framed:  # and it reads back as that message, at its destination
        m, = w.StreamDecoder().messages(bytearray(data), len(data), K, d)
        assert pickle.loads(m.payload) == obj and m.src == 1 and m.group_id == 99


def test_what_is_not_the_usual_message_is_framed_the_general_way():
    ep = Capture()
    core = _core(ep)
    big = b"z" * (1 << 20)  # out of band
    core._post(((0, big),), 0, 1, 5, 0)  # (header, payload, the buffer, a MAC for rank 0)
    (d, frames), = ep.signed
    assert d == 0 and len(frames) == 4 and frames[2] == big
    assert w.decode(frames, K, 0).buffers[0] == big
    core._post(((0, "a"), (2, "b"), (3, "a")), 0, 2, 5, 0)  # different objects: one each
    got = {}
    for [d], data in ep.framed:
        m, = w.StreamDecoder().messages(bytearray(data), len(data), K, d)
        got[d] = pickle.loads(m.payload)
    assert got == {0: "a", 2: "b", 3: "a"} and len(ep.framed) == 3 and not ep.many


class Counted:
    """Counts how often it is pickled; pickles to ``size`` ints, or fails."""

    calls = 0

    def __init__(self, size, fail=False):
        self.size, self.fail = size, fail

    def __reduce__(self):
        Counted.calls += 1
        if self.fail:
            raise ValueError("not today")
        return list, ([7] * self.size,)


@pytest.mark.parametrize(("size", "fail", "passes"), [
    (10, False, 1),  # the usual message: one pass, framed in line
    (100_000, False, 2),  # large: the first pass says so, the second takes it out of band
    (10, True, 1),  # cannot be pickled: said at once
], ids=["small", "large", "failing"])
def test_an_object_is_pickled_no_more_often_than_the_general_way_pickles_it(size, fail,
                                                                           passes):
    """(Pickling runs user code, and costs: the in-line path goes on with what its pass
    found, it does not start again.)"""
    from ctrlcomm import CodecError

    ep = Capture()
    core = _core(ep)
    Counted.calls = 0
    if fail:
        with pytest.raises(CodecError, match="cannot pickle Counted: not today"):
            core._post(((0, Counted(size, fail)),), 0, 1, 5, 0)
    else:
        core._post(((0, Counted(size)),), 0, 1, 5, 0)
        sent = [data for _, data in ep.framed] + [b"".join(f) for _, f in ep.signed]
        assert len(sent) == 1 and len(sent[0]) > 8 * min(size, 8000)
    assert Counted.calls == passes
    Counted.calls = 0
    try:
        w.dumps(Counted(size, fail), w.PICKLE)  # the general way, for comparison
    except CodecError:
        pass
    assert Counted.calls == passes


def test_a_store_request_resent_after_a_stale_reply_is_still_the_request(monkeypatch):
    # A reply to an earlier request that gave up comes first; the request, unanswered, is
    # sent again a second later: that resend must be the request (it was the stale reply's
    # frames, which the client had received into the same variable). A real ZeroMQ ROUTER
    # plays the store, on loopback.
    import zmq

    from ctrlcomm.rendezvous import _conn as t

    monkeypatch.setattr(t, "STORE_RESEND_S", 0.2)
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    conn = t.StoreConnection("127.0.0.1", port)
    seen = []

    def store():
        first = router.recv_multipart()  # request 1: left unanswered (it gives up)
        seen.append(w.decode_store_request(first[2:]))
        second = router.recv_multipart()  # request 2: first the stale reply to request 1
        seen.append(w.decode_store_request(second[2:]))
        router.send_multipart([second[0], b"", *w.encode_store_reply(
            w.StoreReply(w.R_OK, seen[0].req_id, (b"stale",)))])
        resent = router.recv_multipart()  # then request 2 again, resent: answered
        seen.append(w.decode_store_request(resent[2:]))  # (raised: the reply's frames)
        router.send_multipart([resent[0], b"", *w.encode_store_reply(
            w.StoreReply(w.R_OK, seen[2].req_id, (b"fresh",)))])

    th = threading.Thread(target=store, daemon=True)
    th.start()
    try:
        one = w.StoreRequest(w.S_GET, 1, 0.0, (b"k",))
        assert conn.request(one, time.monotonic() + 0.1) is None  # (gave up)
        two = w.StoreRequest(w.S_GET, 2, 0.0, (b"k",))
        rep = conn.request(two, time.monotonic() + 10)
        assert rep is not None and rep.req_id == 2 and rep.values == (b"fresh",)
        th.join(5)
        assert [r.req_id for r in seen] == [1, 2, 2]
    finally:
        conn.close()
        router.close(0)


def test_the_auth_key_fallback_takes_the_given_key_else_a_set_environment_variable(monkeypatch):
    from ctrlcomm.transport._net import auth_key_or_env

    monkeypatch.setenv("CTRLCOMM_AUTH_KEY", "from-env")
    assert auth_key_or_env("given") == b"given"
    assert auth_key_or_env(b"raw\xff") == b"raw\xff"
    assert auth_key_or_env() == b"from-env"
    assert auth_key_or_env(None) == b"from-env"
    monkeypatch.setenv("CTRLCOMM_AUTH_KEY", "")  # empty: unset, as shells have it
    assert auth_key_or_env() is None
    monkeypatch.delenv("CTRLCOMM_AUTH_KEY")
    assert auth_key_or_env() is None
    assert auth_key_or_env("k") == b"k"


def test_each_transport_is_an_endpoint_with_the_capabilities_it_says():
    """The core knows a transport only through ctrlcomm._endpoint's protocols: both of
    ours implement Endpoint, the TCP one the stream and express capabilities too, each as
    its STREAM and EXPRESS flags say; and the heartbeat is what the core asks of liveness."""
    from ctrlcomm._endpoint import Endpoint, ExpressEndpoint, Liveness, StreamEndpoint
    from ctrlcomm.transport import Heartbeat, make_endpoint

    for kind in ("tcp", "zmq"):
        ep = make_endpoint(kind, "127.0.0.1")
        try:
            assert isinstance(ep, Endpoint) and ep.kind == kind
            assert isinstance(ep, StreamEndpoint) == ep.STREAM == (kind == "tcp")
            assert isinstance(ep, ExpressEndpoint) == ep.EXPRESS == (kind == "tcp")
        finally:
            ep.close()
    # (and the in-memory stand-in of the core's own tests, which is no express endpoint)
    from ctrlcomm.testing._standin import StandInEndpoint

    standin = StandInEndpoint()
    assert isinstance(standin, StreamEndpoint) and not isinstance(standin, ExpressEndpoint)
    hb = Heartbeat("127.0.0.1", 0, 0, None, 1.0)
    try:
        assert isinstance(hb, Liveness)
    finally:
        hb.close()
