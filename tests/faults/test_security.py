"""Authentication, replay, the data-only codec, bind hygiene, garbage on every socket."""

import asyncio
import contextlib
import gc
import logging
import os
import pickle
import random
import socket
import struct
import threading
import time

import pytest

import ctrlcomm
from ctrlcomm import _wire as w
from ctrlcomm.rendezvous._conn import _zmtp_mechanism
from ctrlcomm.testing import free_port, run_group, run_ranks

KEY = "s3cret-key-for-tests"


def authed_group(g):
    """Rank 1 opens a second connection to rank 0 and writes a forged frame (another key),
    an unauthenticated one and a genuine one (the group's key, rank 1's next number) on it:
    the first two are dropped as malformed, the third as a second connection claiming rank 1
    (nothing it sends is taken). Then rank 1 writes the genuine frame twice on its own
    connection: rank 0 takes it once, and drops the replay."""
    out = [g.all_reduce(g.rank + 1), g.broadcast("b", src=1)]
    if g.rank == 1:
        addr = g._core.ep.peers[0][len("tcp://"):]
        host, port = addr.rsplit(":", 1)
        gid = g._core.group_id
        forged = w.encode(w.Message(w.P2P, 1, gid, 99, 0, 0, w.NO_ROOT, w.PICKLE,
                                    b"cos\nsystem\n(S'echo pwned'\ntR."), key=b"wrong key")
        unauth = w.encode(w.Message(w.P2P, 1, gid, 99, 0, 0, w.NO_ROOT, w.PICKLE,
                                    b"\x80\x05K\x01."))
        genuine = w.encode(w.Message(w.P2P, 1, gid, 1, 0, 0, w.NO_ROOT, w.PICKLE,
                                     b"\x80\x05\x95\x06\x00\x00\x00\x00\x00\x00\x00\x8c\x02ok\x94."),
                           key=g._core.key, dst=0)
        with socket.create_connection((host, int(port))) as s:
            for frames in (forged, unauth, genuine):
                s.sendall(w.stream_prefix(frames) + b"".join(frames))
            time.sleep(0.3)
        g._core.ep.send(0, genuine)
        g._core.ep.send(0, genuine)  # a replay
    g.barrier()
    if g.rank == 0:
        out.append(g.recv(1, timeout=10))  # the genuine frame, once
        try:
            g.recv(1, timeout=0.5)
        except ctrlcomm.CollectiveTimeoutError:
            out.append("replay dropped")
        out.append(g.stats()["dropped"])
    g.barrier()  # rank 1 stays until rank 0 is done
    return out


def test_authenticated_group_drops_forged_unauthenticated_and_replayed_frames():
    res = run_group(authed_group, 2, group_kwargs={"auth_key": KEY})
    assert res[1] == [3, "b"]
    r0 = res[0]
    assert r0[:4] == [3, "b", "ok", "replay dropped"], r0
    assert r0[4].get("malformed") == 2, r0
    assert r0[4].get("duplicate_source") == 1, r0  # the second connection, at its genuine frame
    assert r0[4].get("replayed") == 1, r0


def replay_behind_the_message_waited_for(g, awaited):
    """Rank 0 waits in recv (the short way takes the message it waits for: see
    test_express); rank 1 writes that message and a replay of it in one piece, as one read
    takes them: the message comes once, the replay behind it is dropped as one."""
    for r in range(2):  # each rank waits once the general way first (see test_express.settle)
        if g.rank == r:
            time.sleep(0.05)
        g.barrier()
    g.barrier()
    if g.rank == 1:
        time.sleep(0.3)  # rank 0 waits in its recv
        genuine = w.encode(w.Message(w.P2P, 1, g._core.group_id, 1, 0, 0, w.NO_ROOT, w.PICKLE,
                                     pickle.dumps("ok", protocol=5)), key=g._core.key, dst=0)
        framed = w.stream_prefix(genuine) + b"".join(genuine)
        g._core.ep.send_framed((0,), [framed + framed])
        g.barrier()
        return None
    out = [asyncio.run(g.aio.recv(1, timeout=10)) if awaited else g.recv(1, timeout=10)]
    try:
        g.recv(1, timeout=0.5)
    except ctrlcomm.CollectiveTimeoutError:
        out.append("replay dropped")
    out.append(g.stats()["dropped"].get("replayed"))
    g.barrier()
    return out


@pytest.mark.parametrize("awaited", [False, True], ids=["blocking", "awaited"])
def test_a_replay_read_behind_the_message_a_recv_waits_for_is_dropped(awaited):
    res = run_group(replay_behind_the_message_waited_for, 2, awaited,
                    group_kwargs={"auth_key": KEY})
    assert res[0] == ["ok", "replay dropped", 1], res[0]


def frame_for_another_rank(g):
    """Rank 1 writes, on a connection of its own to rank 0, genuine frames (the group's key,
    rank 1's next numbers) made for rank 2, as an observer of rank 1's traffic to rank 2
    could replay them: rank 0 takes none, and rank 1's messages to it after them still come."""
    out = []
    if g.rank == 1:
        host, port = g._core.ep.peers[0][len("tcp://"):].rsplit(":", 1)
        gid = g._core.group_id
        with socket.create_connection((host, int(port))) as s:
            for n in (1, 2):
                frames = w.encode(w.Message(w.P2P, 1, gid, n, 0, 0, w.NO_ROOT, w.PICKLE,
                                            pickle.dumps(f"for rank 2 only #{n}")),
                                  key=g._core.key, dst=2)
                s.sendall(w.stream_prefix(frames) + b"".join(frames))
            coll = w.encode(w.Message(w.COLL, 1, gid, g._core.seq, 0, w.OP_CODE["broadcast"], 1,
                                      w.PICKLE, pickle.dumps("a broadcast for rank 2")),
                            key=g._core.key, dst=2)
            s.sendall(w.stream_prefix(coll) + b"".join(coll))
            time.sleep(0.3)
        g.send("genuine 1", 0)
        g.send("genuine 2", 0)
    got = g.broadcast("b" if g.rank == 1 else None, src=1)
    if g.rank == 0:
        out += [got, g.recv(1, timeout=10), g.recv(1, timeout=10)]
        try:
            out.append(g.recv(1, timeout=0.5))
        except ctrlcomm.CollectiveTimeoutError:
            out.append("nothing more")
        out.append(g.stats()["dropped"].get("malformed", 0))
    g.barrier()
    return out


def test_a_genuine_frame_made_for_another_rank_is_refused():
    res = run_group(frame_for_another_rank, 3, group_kwargs={"auth_key": KEY})
    assert res[0] == ["b", "genuine 1", "genuine 2", "nothing more", 3], res[0]


def env_key(rank, size, port):
    os.environ["CTRLCOMM_AUTH_KEY"] = KEY
    with ctrlcomm.Group.create("127.0.0.1", port, rank, size, timeout=20) as g:
        return g.all_gather(rank), g._core.key is not None


def test_key_from_environment():
    assert run_ranks(env_key, 2, free_port()) == [([0, 1], True)] * 2


def test_an_empty_auth_key_is_refused_not_taken_for_none():
    """(before: auth_key="" formed a group without authentication, silently)"""
    for empty in ("", b""):
        with pytest.raises(ctrlcomm.InvalidArgumentError, match="auth_key is empty"):
            ctrlcomm.Group.create("127.0.0.1", free_port(), 0, 1, auth_key=empty, timeout=5)


def test_store_with_key_ignores_clients_without_it():
    with ctrlcomm.StoreServer("127.0.0.1", 0, auth_key=KEY) as srv:
        good = ctrlcomm.StoreClient("127.0.0.1", srv.port, auth_key=KEY, timeout=2)
        good.set("k", "v")
        assert good.get("k") == b"v"
        bad = ctrlcomm.StoreClient("127.0.0.1", srv.port, timeout=1)
        with pytest.raises(ctrlcomm.StoreError):  # (see the test of a client without)
            bad.get("k")
        wrong = ctrlcomm.StoreClient("127.0.0.1", srv.port, auth_key="other", timeout=1)
        with pytest.raises(ctrlcomm.StoreTimeoutError):
            wrong.set("k", "evil")
        assert good.get("k") == b"v"
        assert srv.dropped >= 2
        for c in (good, bad, wrong):
            c.close()


def msgpack_group(g):
    out = [g.all_gather({"rank": g.rank, "t": (1, 2)}), g.all_reduce((g.rank, 2), op="max")]
    try:
        # only the root can tell: the failure travels in the call, and every rank raises
        g.broadcast(object() if g.rank == 0 else None, src=0)
    except ctrlcomm.CodecError as e:
        out.append(str(e))
    out.append(g.all_reduce(1))  # the group still works, in step
    return out


def test_data_only_codec():
    for out in run_group(msgpack_group, 2, group_kwargs={"codec": "msgpack"}):
        assert out[0] == [{"rank": 0, "t": (1, 2)}, {"rank": 1, "t": (1, 2)}]
        assert out[1] == (1, 2)
        assert "msgpack" in out[2] and "object" in out[2]
        assert out[3] == 2


def one_rank_cannot_encode(g):
    """Only rank 1's object is one msgpack cannot encode (only rank 1 can tell): every rank
    that gets a result, and rank 1, raise CodecError, and the group stays in step (the
    all_reduce after each call pairs with the same call everywhere)."""
    bad = object()
    r, n = g.rank, g.world_size
    calls = {
        "broadcast": lambda: g.broadcast(bad if r == 1 else None, src=1),
        "gather": lambda: g.gather(bad if r == 1 else r, dst=0),
        "all_gather": lambda: g.all_gather(bad if r == 1 else r),
        "scatter": lambda: g.scatter([bad] + [0] * (n - 1) if r == 1 else None, src=1),
        "all_to_all": lambda: g.all_to_all([bad if r == 1 else r] * n),
    }
    out = {}
    for i, (name, call) in enumerate(calls.items()):
        try:
            got = ("returned", call())
        except ctrlcomm.CodecError as e:
            got = ("CodecError", str(e))
        out[name] = got, g.all_reduce(i, timeout=10)
    return out


def test_an_object_one_rank_cannot_encode_fails_the_call_and_keeps_the_group_in_step():
    res = run_group(one_rank_cannot_encode, 3, group_kwargs={"codec": "msgpack"})
    for r, out in enumerate(res):
        for i, (name, ((kind, what), after)) in enumerate(out.items()):
            assert after == 3 * i, (r, name, after)
            if name == "gather" and r == 2:  # neither the destination nor the sender
                assert (kind, what) == ("returned", None), (r, name, kind, what)
            else:
                assert kind == "CodecError" and "rank 1" in what, (r, name, kind, what)


def one_rank_cannot_pickle(g, limit):
    """The pickle codec's twin of one_rank_cannot_encode: only rank 1's object cannot be
    sent (it cannot be pickled, or is larger than a message may carry, here ``limit``
    bytes), which rank 1 finds while sending: it sends the failure in its place."""
    import importlib
    import pkgutil
    import threading

    import ctrlcomm._core as core

    for m in pkgutil.iter_modules(core.__path__):  # (each module of the core that reads it)
        mod = importlib.import_module(f"ctrlcomm._core.{m.name}")
        if hasattr(mod, "MAX_PAYLOAD"):
            mod.MAX_PAYLOAD = limit
    r, n = g.rank, g.world_size
    calls = {
        "broadcast": lambda bad: g.broadcast(bad if r == 1 else None, src=1),
        "gather": lambda bad: g.gather(bad if r == 1 else r, dst=0),
        "all_gather": lambda bad: g.all_gather(bad if r == 1 else r),
        "scatter": lambda bad: g.scatter([bad] * n if r == 1 else None, src=1),
        "all_to_all": lambda bad: g.all_to_all([bad if r == 1 else r] * n),
        "all_reduce": lambda bad: g.all_reduce(bad if r == 1 else 1, op=lambda a, b: a),
    }
    out = {}
    i = 0
    for what, bad in (("lock", threading.Lock()), ("large", b"x" * (limit + 1))):
        for name, call in calls.items():
            try:
                got = ("returned", call(bad))
            except ctrlcomm.CodecError as e:
                got = ("CodecError", str(e))
            out[(what, name)] = got, g.all_reduce(i, timeout=10)
            i += 1
    p2p = []
    if r == 1:
        for bad in (threading.Lock(), b"x" * (limit + 1)):
            try:
                g.send(bad, 0)
            except ctrlcomm.CodecError as e:
                p2p.append(str(e))
        g.send("after", 0)
    elif r == 0:
        p2p.append(g.recv(1))
    return out, p2p, g.stats()["state"]


def test_an_object_one_rank_cannot_send_fails_the_call_everywhere_and_keeps_the_group():
    res = run_group(one_rank_cannot_pickle, 3, 1 << 20)
    for r, (out, _, state) in enumerate(res):
        assert state == "open"
        for i, ((what, name), ((kind, text), after)) in enumerate(out.items()):
            assert after == 3 * i, (r, what, name, after)
            if name == "gather" and r == 2:  # neither the destination nor the sender
                assert kind == "returned", (r, what, name, kind, text)
            else:
                assert kind == "CodecError" and f"{name} #" in text and "rank 1" in text, \
                    (r, what, name, kind, text)
                assert ("pickle" if what == "lock" else "GiB encoded") in text, text
    assert res[0][1] == ["after"]
    assert len(res[1][1]) == 2 and "send(dst=0" in res[1][1][0] and "rank 1" in res[1][1][0]
    assert "more than a message carries" in res[1][1][1]


def cannot_pickle_in_a_tree(g, name):
    import threading

    bad, r, n = threading.Lock(), g.rank, g.world_size
    calls = {
        "gather": lambda: g.gather(bad if r == 3 else r, dst=0),
        "scatter": lambda: g.scatter([bad if i == 3 else i for i in range(n)] if r == 0
                                     else None, src=0),
        "all_gather": lambda: g.all_gather(bad if r == 3 else r),
    }
    try:
        return "returned", repr(calls[name]())
    except ctrlcomm.CtrlcommError as e:
        return type(e).__name__, str(e)


@pytest.mark.parametrize("name", ["gather", "scatter", "all_gather"])
def test_an_object_one_rank_cannot_send_in_a_tree_breaks_the_group_everywhere(name,
                                                                               monkeypatch):
    """Log-depth plans (here at world 4) that bundle objects: a failure cannot travel in
    one's place. The rank raises CodecError and tells the others,
    which raise at once (they crashed on the failure, or waited out their deadline, or
    returned a result the others did not)."""
    monkeypatch.setenv("CTRLCOMM_SMALL_WORLD", "2")
    res = run_group(cannot_pickle_in_a_tree, 4, name, timeout=40,
                    group_kwargs={"timeout": 60})
    failing = 0 if name == "scatter" else 3
    for r, (kind, text) in enumerate(res):
        if r == failing:
            assert kind == "CodecError" and f"on rank {failing}" in text, (r, kind, text)
        elif kind == "returned":  # a gather's rank off the failing rank's path: no result
            assert name == "gather" and text == "None", (r, kind, text)
        else:
            assert kind == "PeerLostError" and f"rank {failing} aborted" in text, (r, text)


def cannot_send_a_partial_result(g, how):
    """all_reduce by recursive doubling, where one rank's object cannot be sent (pickle: a
    lock; the op keeps its left operand, so the next partial is sendable again), or where
    a partial result cannot be (msgpack: a sum beyond 64 bits, from operands within)."""
    import threading

    r = g.rank
    try:
        if how == "pickle":
            got = g.all_reduce(threading.Lock() if r == 3 else r, op=lambda a, b: a)
        elif how == "msgpack":
            got = g.all_reduce(2**63 + 5 if r in (1, 2) else 0, op="sum")
        else:  # only the whole result beyond 64 bits: the folded rank alone would send it
            got = g.all_reduce(2**63 - 1, op="sum")
        first = ("returned", repr(got))
    except ctrlcomm.CtrlcommError as e:
        first = (type(e).__name__, str(e))
    return first, g.all_reduce(1), g._core.state


@pytest.mark.parametrize(("size", "how"), [(4, "pickle"), (5, "pickle"), (9, "msgpack"),
                                           (3, "msgpack-result")])
def test_a_partial_result_that_cannot_be_sent_fails_the_all_reduce_and_keeps_the_group(
        size, how, monkeypatch):
    # (before: the failing rank raised and broke the group, its peers got PeerLostError;
    # after a first fix, rank 1 of world 4 returned a result the failure never reached, and
    # at world 3 rank 2 returned the result that rank 1 could not send to rank 0)
    monkeypatch.setenv("CTRLCOMM_SMALL_WORLD", "2")  # recursive doubling at every size
    res = run_group(cannot_send_a_partial_result, size, how, timeout=60,
                    group_kwargs={"codec": how.split("-")[0]})
    for r, ((kind, text), after, state) in enumerate(res):
        assert kind == "CodecError" and "all_reduce #" in text, (r, kind, text)
        if how == "pickle":
            assert "on rank 3" in text, (r, text)
        assert after == size and state == "open", (r, after, state)


def test_what_a_message_may_carry_is_less_than_what_a_receiver_takes():
    import ctrlcomm._core as core

    assert 0 < core.MAX_PAYLOAD < w.MAX_MESSAGE - w.HEADER.size - w.MAC_SIZE


class _NotUnpicklable(Exception):
    """Pickles, but unpickling raises (an exception whose __init__ takes other arguments:
    a classic)."""

    def __init__(self, a, b):
        super().__init__(f"{a}-{b}")


def object_others_cannot_decode(g):
    try:
        out = ("returned", repr(g.all_gather(_NotUnpicklable(1, 2) if g.rank == 0 else g.rank)))
    except ctrlcomm.CodecError as e:
        out = ("CodecError", str(e))
    except ctrlcomm.PeerLostError as e:  # told by the other rank first, and why: its message
        out = ("PeerLostError", str(e))  # can come before rank 0's (rank 0, preempted by the
        # rank its first send woke, sends to the second after it)
    try:  # rank 0 returned; it learns at its next call, told by the others
        g.barrier(timeout=60)
    except ctrlcomm.GroupBrokenError as e:
        return out, type(e).__name__, str(e)
    return out, "barrier returned", ""


def test_an_object_a_rank_cannot_decode_breaks_the_group_everywhere_without_waiting():
    res = run_group(object_others_cannot_decode, 3, timeout=40)
    assert res[0][0][0] == "returned"  # the root of the star decodes nothing of rank 0's
    assert res[0][1] == "PeerLostError" and "cannot decode the object from rank 0" in res[0][2]
    told = 0
    for (kind, text), after, _ in res[1:]:
        if kind == "PeerLostError":  # (the other rank's abort came first: it says why)
            told += 1
            assert "aborted the group" in text and "cannot decode the object from rank 0" in text
        else:
            assert kind == "CodecError" and "from rank 0" in text, text
        # (a group broken by a lost peer says so again: PeerLostError; by its own failure:
        # GroupBrokenError; a rank that failed to decode it itself may have read the other's
        # word first: its group's first cause)
        assert after == "PeerLostError" if kind == "PeerLostError" else \
            after in ("GroupBrokenError", "PeerLostError"), (kind, after)
    assert told < 2  # one of them decoded first, and failed itself


class _OpensAFile:
    """Unpickling this creates the file: proof that a payload was unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def pickle_into_msgpack_group(g, marker):
    core = g._core
    if g.rank == 1:
        # rank 1 (misconfigured, or not what it claims) sends its all_gather contribution
        # pickled, with a header that says so, to a group whose codec is msgpack
        payload = pickle.dumps(_OpensAFile(marker), protocol=5)
        core.ep.send(0, w.encode(w.Message(w.COLL, 1, core.group_id, core.seq, 0,
                                           w.OP_CODE["all_gather"], w.NO_ROOT, w.PICKLE,
                                           payload), core.key, 0))
        try:
            g.recv(0, timeout=20)  # until rank 0 is done and tells it, or closes the group
        except ctrlcomm.GroupBrokenError:
            pass
        return None
    try:
        g.all_gather({"rank": 0})
    except ctrlcomm.CodecError as e:
        return str(e)
    return "decoded"


def test_data_only_group_never_unpickles_whatever_the_header_says(tmp_path):
    marker = str(tmp_path / "unpickled")
    out = run_group(pickle_into_msgpack_group, 2, marker, group_kwargs={"codec": "msgpack"})
    assert not os.path.exists(marker)
    assert "rank 1" in out[0] and "never unpickles" in out[0]


def test_binding_every_interface_without_key_warns(caplog, monkeypatch):
    from ctrlcomm.transport import _net

    monkeypatch.setattr(_net, "_warned_unkeyed", False)  # (said once per process)
    with caplog.at_level(logging.WARNING, logger="ctrlcomm"), \
            ctrlcomm.Group.create("127.0.0.1", free_port(), 0, 1, bind_host="0.0.0.0") as g:
        assert g.all_reduce(1) == 1
    assert any("binds 0.0.0.0" in r.getMessage() and "without an auth_key" in r.getMessage()
               for r in caplog.records)


def test_default_bind_is_the_interface_to_the_store_not_every_interface():
    with ctrlcomm.Group.create("127.0.0.1", free_port(), 0, 1) as g:
        assert g._core.ep.address.startswith("tcp://127.0.0.1:")


def garbage_everywhere(g):
    """Rank 1 throws garbage at rank 0's sockets while both keep computing."""
    rng = random.Random(1234)
    ep0 = g._core.ep.peers[0][len("tcp://"):]
    host, port = ep0.rsplit(":", 1)
    port = int(port)
    stop = threading.Event()
    sent = {"conns": 0}

    def attack():
        gid = g._core.group_id
        good = w.encode(w.Message(w.COLL, 1, gid, 10**9, 0, 1, w.NO_ROOT, w.PICKLE, b"N."))
        payloads = [
            lambda: rng.randbytes(rng.randint(1, 4096)),
            lambda: (w.stream_prefix(good) + b"".join(good))[: rng.randint(1, 60)],
            lambda: w.STREAM_HEAD.pack(w.STREAM_MAGIC, 1) + struct.pack("<Q", 1 << 62),
            lambda: w.STREAM_HEAD.pack(w.STREAM_MAGIC, 60000),
            lambda: (lambda fr: w.stream_prefix(fr) + b"".join(fr))(
                [bytes([*good[0][:2], 9, *good[0][3:]]), good[1]]),
        ]
        while not stop.is_set():
            try:
                with socket.create_connection((host, port), timeout=1) as s:
                    sent["conns"] += 1
                    s.sendall(rng.choice(payloads)())
            except OSError:
                pass
        # a flood of idle connections
        socks = []
        for _ in range(300):
            try:
                socks.append(socket.create_connection((host, port), timeout=1))
            except OSError:
                break
        time.sleep(0.3)
        for s in socks:
            s.close()

    if g.rank == 1:
        t = threading.Thread(target=attack)
        t.start()
    results = []
    for i in range(300):
        results.append(g.all_reduce((i, g.rank), op="sum"))
    if g.rank == 1:
        stop.set()
        t.join()
    g.barrier()
    ok = all(r == (2 * i, 1) for i, r in enumerate(results))
    gc.collect()
    with open("/proc/self/status") as f:
        rss = next(int(x.split()[1]) for x in f if x.startswith("VmRSS"))
    return ok, g.stats()["dropped"], sent["conns"], rss, len(g._core.ep.conns)


@pytest.mark.slow
def test_garbage_on_every_socket_changes_nothing():
    (ok0, dropped, _, rss, conns), (ok1, _, attacks, _, _) = run_group(garbage_everywhere, 2)
    print(f"garbage: {attacks} attacking connections + 300 idle ones; rank 0 dropped {dropped}, "
          f"RSS {rss} KiB, {conns} connections left; 300 all_reduce results correct: {ok0}")
    assert ok0 and ok1
    assert attacks > 10
    assert dropped.get("malformed_stream", 0) + dropped.get("malformed", 0) > 0
    assert rss < 200_000  # KiB: bounded
    assert conns < 20  # garbage connections were dropped, idle ones closed by their peer


def idle_connections_first(g):
    """Before any rank has sent anything (connections are made at a rank's first send to a
    peer), rank 2 opens 300 idle connections to each other rank's port and keeps them open:
    anyone can, without the key. The ranks then compute."""
    socks = []
    if g.rank == 2:
        for r in (0, 1):
            host, port = g._core.ep.peers[r][len("tcp://"):].rsplit(":", 1)
            for _ in range(300):
                socks.append(socket.create_connection((host, int(port)), timeout=5))
        time.sleep(0.5)  # (accepted, each in its turn)
    else:
        time.sleep(2.0)
    out = [g.all_gather(g.rank) for _ in range(3)] + [g.all_reduce(1)]
    # a rank accepts connections as it waits in its calls, a batch at a time: the ranks go on
    # calling until ranks 0 and 1 have each taken (and dropped over the limit) all 300
    # (a loaded machine had accepted a part only by the fourth call)
    for _ in range(2000):
        dropped = g.stats()["dropped"]
        short = g.rank != 2 and dropped.get("connection_limit", 0) < 300 - 256
        if g.all_reduce(int(short)) == 0:
            break
    g.barrier()
    for s in socks:
        s.close()
    return out, dropped


def test_idle_connections_do_not_keep_the_peers_out():
    # (before: they took the 256 places for inbound connections, the peers' were refused,
    # and every rank failed naming a live rank lost)
    res = run_group(idle_connections_first, 3, timeout=120,
                    group_kwargs={"auth_key": b"k" * 16})
    for out, _ in res:
        assert out == [[0, 1, 2]] * 3 + [3]
    assert all(res[r][1].get("connection_limit", 0) >= 300 - 256 for r in (0, 1)), res


def declared_huge_before_identified(g):
    """Rank 1 opens a connection to rank 0 (keyed group) whose first message declares 1 GiB,
    then streams zeros: nothing authenticates it until the whole message has come."""
    out = None
    if g.rank == 1:
        host, port = g._core.ep.peers[0][len("tcp://"):].rsplit(":", 1)
        sent = 0
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(w.STREAM_HEAD.pack(w.STREAM_MAGIC, 2) + struct.pack("<2Q", 48, 1 << 30))
            try:
                for _ in range(256):  # 32 MiB
                    s.sendall(bytes(128 * 1024))
                    sent += 128 * 1024
            except OSError:  # dropped by rank 0
                pass
        out = sent
    g.barrier()
    if g.rank == 0:
        out = g.stats()["dropped"], sum(c.decoder.pending() for c in g._core.ep.conns.values()
                                        if c.inbound)
    g.barrier()
    return out


def test_a_connection_not_identified_yet_takes_small_messages_only():
    # (before: what it sent was buffered toward the 1 GiB message, up to 2 GiB per
    # connection, 256 connections, before a MAC could be checked)
    (dropped, pending), sent = run_group(declared_huge_before_identified, 2, timeout=120,
                                         group_kwargs={"auth_key": b"k" * 16})
    assert dropped.get("malformed_stream") == 1, dropped
    assert pending == 0 and sent < 32 << 20, (pending, sent)


def cycles(rank, size, port, n):
    import threading as th

    def fds():
        return len(os.listdir("/proc/self/fd"))

    with ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="warm") as g:
        g.barrier()
    base_fds, base_threads = fds(), th.active_count()
    for i in range(n):
        with ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="cycle",
                                   timeout=30) as g:
            g.all_reduce(i)
    time.sleep(1.0)
    return base_fds, fds(), base_threads, th.active_count()


@pytest.mark.slow
def test_no_leaks_after_1000_create_close_cycles():
    (bf, af, bt, at), = run_ranks(cycles, 1, free_port(), 1000, timeout=300)
    assert af - bf <= 2, f"file descriptors {bf} -> {af}"
    assert at - bt <= 1, f"threads {bt} -> {at}"


def test_no_leaks_with_peers():
    res = run_ranks(cycles, 3, free_port(), 30, timeout=120)
    for bf, af, bt, at in res:
        assert af - bf <= 2 and at - bt <= 1, (bf, af, bt, at)


def speaks_for_another_rank(g):
    """Rank 2 writes, on its own connection to rank 0, a message whose header says rank 1
    sent it (rank 1's first point-to-point number: what rank 1's next send to rank 0
    carries): rank 0 drops it, counted, and takes rank 1's own message."""
    g.barrier()  # (every connection made)
    if g.rank == 2:
        forged = w.encode(w.Message(w.P2P, 1, g._core.group_id, 1, 0, 0, w.NO_ROOT, w.PICKLE,
                                    pickle.dumps("forged by rank 2")),
                          key=g._core.key, dst=0)
        g._core.ep.send(0, forged)
        g.send("rank 2's own", 0)
    g.barrier()
    if g.rank == 1:
        time.sleep(0.2)  # (rank 2's messages are there first)
        g.send("rank 1's own", 0)
    out = []
    if g.rank == 0:
        out = [g.recv(2, timeout=10), g.recv(1, timeout=10)]
        try:
            out.append(g.recv(1, timeout=0.5))
        except ctrlcomm.CollectiveTimeoutError:
            out.append("nothing more")
        out.append(g.stats()["dropped"].get("wrong_sender", 0))
        out.append(g.all_reduce(1))
    else:
        g.all_reduce(1)
    g.barrier()
    return out


@pytest.mark.parametrize("key", [None, KEY], ids=["unkeyed", "keyed"])
def test_a_rank_cannot_speak_for_another_on_its_connection(key):
    res = run_group(speaks_for_another_rank, 3, group_kwargs={"auth_key": key})
    assert res[0] == ["rank 2's own", "rank 1's own", "nothing more", 1, 3], res[0]


def _zmtp_null_connect(port, kind=b"DEALER"):
    """A raw ZeroMQ (ZMTP 3.0, NULL mechanism) peer, as anyone on the network can be: a
    socket of ``kind`` that has said hello, with plain socket calls (so that a frame can be
    left open)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        s.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00")
                  + b"\x00" * 32)
        got = b""
        while len(got) < 64:
            chunk = s.recv(64 - len(got))
            assert chunk, "closed during the greeting"
            got += chunk
    except BaseException:
        s.close()
        raise
    name = b"Socket-Type"
    body = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(kind)) + kind
    s.sendall(b"\x04" + bytes([len(body)]) + body)
    return s


def test_a_store_drops_a_connection_that_declares_a_frame_longer_than_a_request_takes():
    """A connection declaring a frame of 4 GiB is closed at once, nothing buffered toward
    it (one that made the store buffer all it sent would grow it without bound). A value
    over the limit is refused by the client before it is sent. (A store without a key: one
    with a key refuses such a peer at its handshake, below.)"""
    with ctrlcomm.StoreServer("127.0.0.1", 0) as srv:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s.sendall(w.store_hello(os.urandom(16)) + struct.pack("<2sII", b"CQ", 1, 2**32 - 1))
        closed, chunk = False, b"\x00" * (1 << 16)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not closed:
            try:
                s.sendall(chunk)
            except OSError:  # (reset or broken pipe: dropped)
                closed = True
        s.close()
        assert closed, "the store kept taking the frame"
        c = ctrlcomm.StoreClient("127.0.0.1", srv.port, timeout=10)
        c.set("k", b"v" * (16 << 20))  # (the longest value still goes)
        assert len(c.get("k")) == 16 << 20
        with pytest.raises(ctrlcomm.InvalidArgumentError, match="over the store's limit"):
            c.set("k2", b"v" * ((16 << 20) + 1))
        assert not c.check(["k2"])
        with pytest.raises(ctrlcomm.InvalidArgumentError, match="a key of 4097 bytes"):
            c.set("k" * 4097, "v")  # (one of 17 MiB waited out its timeout, then blamed
        with pytest.raises(ctrlcomm.InvalidArgumentError, match="a value of"):  # the key)
            c.append("k", "v")  # (a value grown past the limit: said without naming an op)
        c.close()


def _zmtp_null_refused(port, kind=b"DEALER"):
    """Whether a ZeroMQ peer without a key (ZMTP's NULL mechanism; a socket of ``kind``) is
    refused at its handshake: closed before it could send a frame; False where it got in."""
    try:
        s = _zmtp_null_connect(port, kind)
    except (AssertionError, OSError):
        return True
    try:  # (in: a message of empty frames goes, as one of millions would, buffered whole)
        s.sendall(b"\x01\x00" * 1000 + b"\x00\x00")
        time.sleep(0.3)
        s.sendall(b"\x00\x00")
        return False
    except OSError:
        return True
    finally:
        s.close()


def test_a_keyed_store_refuses_a_zeromq_peer_without_the_key_at_its_handshake():
    """(Before: a keyed store's ZeroMQ socket took any ZMTP peer's messages, and ZeroMQ
    buffers a message whole before ctrlcomm sees it: one of millions of empty frames, 40
    MiB sent, grew the store's process to 1.28 GB and stalled it 37 s.) With a key, its
    handshake needs the key; without one it takes anyone, as the README says (checked too,
    so that the test can fail), and so does a group's socket with transport="zmq" and
    without encrypt=True (README, Security), with a key or not; with encrypt=True it needs
    the key pair the rank published."""
    with ctrlcomm.StoreServer("127.0.0.1", 0, auth_key=KEY) as srv:
        assert _zmtp_null_refused(srv.port)
        c = ctrlcomm.StoreClient("127.0.0.1", srv.port, auth_key=KEY, timeout=10)
        c.set("k", "v")  # (the store serves whoever has the key)
        assert c.get("k") == b"v"
        wrong = ctrlcomm.StoreClient("127.0.0.1", srv.port, auth_key="other", timeout=1)
        with pytest.raises(ctrlcomm.StoreTimeoutError, match="another auth_key"):
            wrong.get("k")
        deadline = time.monotonic() + 5
        while srv.dropped < 2 and time.monotonic() < deadline:  # (counted: both refused)
            time.sleep(0.05)
        assert srv.dropped >= 2
        c.close()
        wrong.close()
    with ctrlcomm.StoreServer("127.0.0.1", 0) as srv:
        # a store without a key speaks its own framing: a ZeroMQ peer is told the store's
        # mechanism (NULL), then closed
        assert _zmtp_mechanism("127.0.0.1", srv.port, 5) == b"NULL"
        assert _zmtp_null_refused(srv.port)
        # a keyed client of a store without a key is told so, not left to its deadline
        # (its handshake fails unanswered; the store's greeting names its mechanism)
        keyed = ctrlcomm.StoreClient("127.0.0.1", srv.port, auth_key=KEY, timeout=30)
        t = time.monotonic()
        with pytest.raises(ctrlcomm.StoreError, match="runs without this group's auth_key"):
            keyed.get("k")
        assert time.monotonic() - t < 10
        keyed.close()
    for key, encrypt in ((KEY, True), (KEY, False), (None, False)):
        with ctrlcomm.Group.create("127.0.0.1", free_port(), 0, 1, transport="zmq",
                                   auth_key=key, encrypt=encrypt, timeout=10) as g:
            port = int(g._core.ep.address.rsplit(":", 1)[1])
            assert _zmtp_null_refused(port, b"PUSH") is encrypt, (key, encrypt)
            assert g.all_reduce(3) == 3


@pytest.mark.parametrize("encrypt", [False, True], ids=["keyed", "encrypted"])
def test_a_client_without_the_key_is_told_at_once_and_counted_by_the_store(encrypt):
    """A client without a key of a store with one (or with encryption): its handshake fails
    unanswered, and where ZeroMQ saw the mechanism differ on the client's side first, it
    never tries again. (Before: the request waited out its whole deadline, 300 s by
    default, and such a store could count nothing of it, so that rank 0 could not say a
    rank without the key had come.) The store's greeting names its mechanism: the client
    raises at its first look, and the store has seen, and counted, a client without the
    key."""
    with ctrlcomm.StoreServer("127.0.0.1", 0, auth_key=KEY, encrypt=encrypt) as srv:
        good = ctrlcomm.StoreClient("127.0.0.1", srv.port, auth_key=KEY, encrypt=encrypt,
                                    timeout=10)
        good.set("k", "v")
        bad = ctrlcomm.StoreClient("127.0.0.1", srv.port, timeout=30)
        for call in (lambda: bad.get("k"), lambda: bad.set("k", "evil")):
            t = time.monotonic()
            with pytest.raises(ctrlcomm.StoreError, match="runs with an auth_key, or "
                               "encryption, and this client has neither") as e:
                call()
            assert not isinstance(e.value, ctrlcomm.StoreTimeoutError)
            assert time.monotonic() - t < 10
        # (the store's thread counts the failed handshake as its socket monitor reports it,
        # which may be just after the client read the greeting and raised)
        end = time.monotonic() + 10
        while srv.dropped < 1 and time.monotonic() < end:
            time.sleep(0.01)
        assert srv.dropped >= 1
        assert good.get("k") == b"v"  # (the store is as it was)
        for c in (good, bad):
            c.close()
    # a client's look is counted itself (a store no client has tried: apart from ZeroMQ's
    # own attempts, whose count comes when the store's thread reads them)
    with ctrlcomm.StoreServer("127.0.0.1", 0, auth_key=KEY, encrypt=encrypt) as srv:
        assert _zmtp_mechanism("127.0.0.1", srv.port, 5) == b"CURVE"  # (only a look)
        assert _zmtp_mechanism("127.0.0.1", srv.port, 5, null=True) == b"CURVE"
        deadline = time.monotonic() + 10
        while srv.dropped == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert srv.dropped == 1
    # the same client, once its store runs as it does (restarted on its port), is answered:
    # ZeroMQ made no new connection after the failed handshake, the client makes a socket
    port = free_port()
    bad = ctrlcomm.StoreClient("127.0.0.1", port, timeout=30)
    with ctrlcomm.StoreServer("127.0.0.1", port, auth_key=KEY, encrypt=encrypt), \
            pytest.raises(ctrlcomm.StoreError, match="this client has neither"):
        bad.set("k", "v")
    with ctrlcomm.StoreServer("127.0.0.1", port):
        t = time.monotonic()
        bad.set("k", "v")
        assert bad.get("k") == b"v"
        assert time.monotonic() - t < 10
    bad.close()
    with ctrlcomm.StoreServer("127.0.0.1", 0) as srv:  # (a store without: no look misfires)
        c = ctrlcomm.StoreClient("127.0.0.1", srv.port, timeout=10)
        other = ctrlcomm.StoreClient("127.0.0.1", srv.port, timeout=5)
        late = threading.Timer(1.6, lambda: other.set("late", "x"))
        late.start()
        assert c.get("late") == b"x"  # (unanswered for 1.6 s: looked at once, and waited on)
        late.join()
        c.close()
        other.close()


@pytest.mark.parametrize("key", [KEY, None], ids=["keyed", "unkeyed"])
def test_a_request_keeps_its_deadline_where_the_store_port_never_greets(key):
    """A client looks at an unanswering store's greeting (see the tests above); where
    none comes (a port that accepts and says nothing, or sends a byte at a time), the
    request still ends at its deadline. (Found in review: the wait after the look slept
    the look's time past the deadline, and a peer sending a byte every 0.4 s held a 3 s
    request for 15 s.)"""
    quiet = socket.socket()
    quiet.bind(("127.0.0.1", 0))
    quiet.listen()
    port = quiet.getsockname()[1]
    conns = []
    stop = threading.Event()

    def drip():  # (each connection gets a byte of a greeting every 0.4 s)
        quiet.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conns.append(quiet.accept()[0])
            for c in conns:
                with contextlib.suppress(OSError):
                    c.send(b"\xff")
            stop.wait(0.4)

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    c = ctrlcomm.StoreClient("127.0.0.1", port, auth_key=key, timeout=1.5)
    try:
        for _ in range(2):
            start = time.monotonic()
            with pytest.raises(ctrlcomm.StoreTimeoutError):
                c.set("k", "v")
            assert time.monotonic() - start < 1.85
    finally:
        stop.set()
        t.join()
        c.close()
        for s in conns:
            s.close()
        quiet.close()


@pytest.mark.parametrize(("key", "encrypt"), [(KEY, False), (KEY, True)],
                         ids=["keyed", "encrypted"])
def test_a_client_that_makes_a_new_socket_is_answered_at_once_and_its_resend_is_known(
        key, encrypt):
    """A client whose handshake failed on its side makes a new socket (ZeroMQ never
    connects the old one again); where a store with a key still holds the old connection,
    the new one takes its routing id over. (Found in review: ZeroMQ's ROUTER refused the
    new connection, and the client was not answered within 10 s.) A request sent on both is
    applied once. (A store without a key hands nothing over: see the next test. There a
    new socket follows a handshake that failed, a connection the store never took.)"""
    with ctrlcomm.StoreServer("127.0.0.1", 0, auth_key=key, encrypt=encrypt) as srv:
        c = ctrlcomm.StoreClient("127.0.0.1", srv.port, auth_key=key, encrypt=encrypt,
                                 timeout=10)
        assert c.add("n", 1) == 1
        old = c._conn.sock
        c._conn._stale = True  # (as after a failed handshake: the next send renews it)
        t = time.monotonic()
        assert c.add("n", 1) == 2
        assert time.monotonic() - t < 5
        assert c._conn.sock is not old and old.closed
        assert c.add("n", 1) == 3
        c.close()


def test_a_peer_with_a_clients_id_cannot_take_its_connection_over():
    """A store without a key does not hand a client's id over to a new connection while
    the client's is open: a peer that read the id off the wire (its hello sends it in
    clear) is closed, gets nothing of it, and the client is answered."""
    with ctrlcomm.StoreServer("127.0.0.1", 0) as srv:
        c = ctrlcomm.StoreClient("127.0.0.1", srv.port, timeout=10)
        c.set("a", "1")
        thief = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        try:
            thief.sendall(w.store_hello(c._conn._id))
            time.sleep(0.5)
            other = ctrlcomm.StoreClient("127.0.0.1", srv.port, timeout=10)
            late = threading.Timer(0.5, lambda: other.set("late", "secret"))
            late.start()
            assert c.get("late") == b"secret"
            late.join()
            thief.settimeout(2)
            assert thief.recv(100) == b""  # (closed; the thief got no reply)
            assert c.get("a") == b"1"
            other.close()
        finally:
            thief.close()
            c.close()


def test_a_new_socket_without_a_watch_on_its_handshakes_is_not_taken(monkeypatch):
    """(Found in review: where the new socket's monitor could not be made, out of
    descriptors, the client took the socket anyway, and never again made a new one after
    a failed handshake.) The old socket stays, and the next send tries again."""
    import zmq

    from ctrlcomm.rendezvous import _conn

    with ctrlcomm.StoreServer("127.0.0.1", 0, auth_key=KEY) as srv:  # (see above)
        c = ctrlcomm.StoreClient("127.0.0.1", srv.port, auth_key=KEY, timeout=10)
        c.set("a", "1")
        old = c._conn.sock
        c._conn._stale = True
        monkeypatch.setattr(_conn, "_monitor", lambda sock, events: None)
        # nor is it connected: at a keyed store (ROUTER_HANDOVER) its connection, with the
        # client's routing id, took the old socket's replies, lost as the new socket closed
        # (seen once in CI: the get unanswered)
        connects = []
        real_connect = zmq.Socket.connect
        monkeypatch.setattr(zmq.Socket, "connect",
                            lambda sock, addr: (connects.append(addr), real_connect(sock, addr))[1])
        assert c.get("a") == b"1"
        assert c._conn.sock is old and c._conn._stale
        assert connects == []
        monkeypatch.undo()
        assert c.get("a") == b"1"
        assert c._conn.sock is not old and not c._conn._stale and c._conn._events is not None
        c.close()
