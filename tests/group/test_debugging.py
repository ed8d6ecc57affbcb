"""Telling what a group waits for: the flight recorder (Group.flight_record, carried by the
errors, dumped on a signal), the warnings a long wait logs, and rank 0's failure to bind its
store reaching the ranks that wait for it."""

import json
import logging
import os
import signal
import threading
import time

import pytest

import ctrlcomm
from ctrlcomm.testing import free_port, run_ranks


def some_calls(rank, size, port, keep):
    if keep is not None:
        os.environ["CTRLCOMM_FLIGHT_RECORD"] = keep
    with ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="fr", timeout=30) as g:
        g.all_reduce(rank + 1)
        if rank == 1:
            time.sleep(0.3)  # (rank 0 waits for the root)
        g.broadcast(b"x" * 1000 if rank == 1 else None, src=1)
        if rank == 0:
            g.send({"a": 1}, dst=1, tag=7)
        else:
            g.recv(src=0, tag=7)
        g.gather(rank, dst=0)
        return g.flight_record()


def test_the_flight_record_keeps_the_last_calls():
    recs = run_ranks(some_calls, 2, free_port(), None)
    ops = [[(c["op"], c["seq"]) for c in r] for r in recs]
    assert ops[0] == [("all_reduce", 0), ("broadcast", 1), ("send", None), ("gather", 2)]
    assert ops[1] == [("all_reduce", 0), ("broadcast", 1), ("recv", None), ("gather", 2)]
    for r in recs:
        assert all(c["state"] == "done" and c["error"] is None for c in r)
        assert all(c["duration_s"] >= 0 and abs(c["started"] - time.time()) < 60 for c in r)
    b0, b1 = recs[0][1], recs[1][1]
    assert b0["root"] == b1["root"] == 1
    assert b1["bytes_sent"] > 1000 and b1["messages_sent"] == 1 and b1["messages_received"] == 0
    assert b0["bytes_received"] > 1000 and b0["messages_received"] == 1
    assert b0["waited_for"] == [1]  # (the root, the one it waited for)
    send, recv = recs[0][2], recs[1][2]
    assert (send["peer"], send["tag"], recv["peer"], recv["tag"]) == (1, 7, 0, 7)
    assert send["bytes_sent"] == recv["bytes_received"] > 0
    assert recs[0][3]["messages_received"] == 1 and recs[1][3]["messages_received"] == 0


def test_the_flight_record_keeps_as_many_as_asked():
    recs = run_ranks(some_calls, 2, free_port(), "2")
    assert [c["op"] for c in recs[0]] == ["send", "gather"]
    recs = run_ranks(some_calls, 2, free_port(), "0")
    assert recs == [[], []]


def bad_setting(rank, size, port):
    os.environ["CTRLCOMM_FLIGHT_RECORD"] = "many"
    try:
        ctrlcomm.Group.create("127.0.0.1", port, rank, size, timeout=5)
    except ctrlcomm.InvalidArgumentError as e:
        return str(e)
    return None


def test_a_bad_flight_record_setting_is_named():
    (text,) = run_ranks(bad_setting, 1, free_port())
    assert "CTRLCOMM_FLIGHT_RECORD" in text and "'many'" in text


def fails(rank, size, port, how):
    g = ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="fail", timeout=30)
    g.all_reduce(1)
    try:
        if how == "timeout":
            if rank == 0:
                g.barrier(timeout=1.5)
            else:  # (rank 0 gave up meanwhile, and told it; its call is another)
                time.sleep(2.5)
                g.all_gather(1, timeout=5)
        elif rank == 0:
            g.all_reduce(1, timeout=20)
        else:  # (both wait: each gets a message of the other's call)
            g.all_gather(1, timeout=20)
    except ctrlcomm.CtrlcommError as e:
        return type(e).__name__, list(e.flight_record)
    finally:
        g.close()
    return None


def test_errors_carry_the_flight_record():
    res = run_ranks(fails, 2, free_port(), "timeout")
    name, rec = res[0]
    assert name == "CollectiveTimeoutError"
    assert [c["op"] for c in rec] == ["all_reduce", "barrier"]
    assert rec[1]["state"] == "running" and rec[1]["waited_for"] == [1]
    assert rec[1]["duration_s"] >= 1.4
    name, rec = res[1]  # (told of rank 0's abort, or a mismatch: it carries it too)
    assert name in ("PeerLostError", "MismatchError", "MismatchTimeoutError"), name
    assert rec[-1]["op"] == "all_gather" and rec[-1]["state"] == "running"
    for name, rec in run_ranks(fails, 2, free_port(), "mismatch"):
        assert issubclass(getattr(ctrlcomm, name), ctrlcomm.MismatchError), name
        assert rec[-1]["op"] in ("all_reduce", "all_gather") and rec[-1]["seq"] == 1
        assert rec[0]["state"] == "done"


def dumps(rank, size, port, path):
    g = ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="dump", timeout=30)
    g.all_reduce(rank)
    if rank == 1:
        time.sleep(1.5)  # (rank 0 waits for it in a barrier, and dumps meanwhile)
        g.barrier()
        g.close()
        return None
    with open(path, "w") as f:
        ctrlcomm.dump_flight_records_on(signal.SIGUSR1, file=f)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        g.barrier()
        g.close()
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_the_flight_record_is_dumped_on_a_signal(tmp_path):
    lines = run_ranks(dumps, 2, free_port(), str(tmp_path / "dump.jsonl"))[0]
    (d,) = [x for x in lines if x["group"] == "dump"]
    assert (d["rank"], d["world_size"], d["state"], d["pid"] != os.getpid()) == \
        (0, 2, "open", True)
    assert [c["op"] for c in d["calls"]] == ["all_reduce", "barrier"]
    assert d["calls"][1]["state"] == "running" and d["calls"][1]["waited_for"] == [1]


def dump_fails(rank, size, port):
    g = ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="dumpfail", timeout=30)
    if rank == 1:
        time.sleep(1.0)
    else:
        with open(os.devnull, "w") as f:
            ctrlcomm.dump_flight_records_on(signal.SIGUSR1, file=f)
        # (the file is closed: the dump fails inside the barrier, which goes on)
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    out = g.all_reduce(rank + 1)
    g.close()
    return out


def test_a_dump_that_fails_leaves_the_call_and_group_be(capfd):
    assert run_ranks(dump_fails, 2, free_port()) == [3, 3]
    assert "flight record dump failed" in capfd.readouterr().err


def test_dump_on_signal_refuses_a_bad_signal():
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="signal"):
        ctrlcomm.dump_flight_records_on(99999)


class _Kept(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.said = []

    def emit(self, record):
        self.said.append(record.getMessage())


def waits_long(rank, size, port):
    kept = _Kept()
    logging.getLogger("ctrlcomm").addHandler(kept)
    if rank == 2:
        time.sleep(6.5)  # (first warning: a tenth of the timeout, 5 s at least)
    g = ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="slow", timeout=20)
    formation = list(kept.said)
    if rank == 2:
        time.sleep(8)  # (the barrier asks 1, 3, 7 s into it: warns at 7 s)
    g.barrier(timeout=20)
    g.close()
    return formation, kept.said[len(formation):]


@pytest.mark.slow
def test_a_long_wait_warns_what_it_waits_for():
    res = run_ranks(waits_long, 3, free_port())
    formation, calls = res[0]
    assert any("formation of 'slow', rank 0: " in s and "s of 20 s, waiting for ranks [2] to join"
               in s for s in formation), formation
    assert any("formation of 'slow', rank 1: " in s and "ranks [2] to join" in s
               for s in res[1][0]), res[1][0]
    assert res[2] == ([], [])  # (it waited for nobody long)
    # (each names the rank it waits for, and what that one said it waits for: a barrier's
    # ranks may wait for each other in a tree)
    for rank in (0, 1):
        said = res[rank][1]
        assert any(f"barrier #0 on group 'slow', rank {rank}: 7 s of 20 s, waiting for ranks ["
                   in s and "[2]" in s for s in said), said


def held_port(rank, size, port):
    t = time.monotonic()
    try:
        ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="held", timeout=20)
    except ctrlcomm.CtrlcommError as e:
        return type(e).__name__, str(e), time.monotonic() - t
    return None


def test_rank0s_failure_to_bind_reaches_the_others():
    # another program's store holds the port (a group of another job, say)
    with ctrlcomm.StoreServer("127.0.0.1", 0) as other:
        res = run_ranks(held_port, 3, other.port)
    assert res[0][0] == "StoreError" and "address already in use" in res[0][1]
    for name, text, took in res[1:]:
        assert name == "FormationError" and "rank 0 failed" in text, text
        assert "address already in use" in text
        assert took < 10, took  # (told at once: not at its 20 s deadline)
