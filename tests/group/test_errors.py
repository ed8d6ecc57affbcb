"""Deadlines, mismatches, bad input and states, with real ranks over real sockets."""

import asyncio
import os
import re
import threading
import time
from collections import namedtuple

import pytest

import ctrlcomm
from ctrlcomm import _wire
from ctrlcomm.testing import RankFailedError, free_port, run_group, run_ranks


def one_rank_absent(g):
    """Rank 2 never calls: the others time out naming it, within (about) the deadline."""
    if g.rank == 2:
        time.sleep(2.0)
        return None
    t = time.monotonic()
    try:
        g.all_reduce(1, timeout=0.8)
    except ctrlcomm.CollectiveTimeoutError as e:
        took = time.monotonic() - t
        after = None
        try:
            g.barrier()
        except ctrlcomm.GroupBrokenError as b:
            after = str(b)
        # leaving (closing) before the other rank's deadline would end its wait otherwise
        g.store.set(f"test/timed-out/{g.rank}", "1")
        g.store.wait(["test/timed-out/0", "test/timed-out/1"], timeout=60)
        return str(e), e.op, e.seq, e.group, e.waiting_for, took, after
    return "no error"


def test_timeout_names_op_seq_group_and_missing_rank():
    res = run_group(one_rank_absent, 3)
    for r in (0, 1):
        msg, op, seq, group, waiting, took, after = res[r]
        assert op == "all_reduce" and seq == 0 and group == "default"
        assert "all_reduce #0" in msg and "'default'" in msg
        assert 2 in waiting and f"[{2}]" in msg or "2]" in msg
        assert 0.7 < took < 1.5, took
        assert after is not None and "timed out" in after  # broken, naming the first cause


def both_receive(g):
    """Each rank waits to receive a broadcast from the other: nobody sends, both time out,
    and each timeout says what the other rank was doing."""
    t = time.monotonic()
    try:
        # (asked at 1 s, FIRST_PROBE: 2 s for the answer, which a loaded machine has
        # delayed past a 1.5 s deadline once)
        g.broadcast(None, src=1 - g.rank, timeout=3.0)
    except ctrlcomm.CollectiveTimeoutError as e:
        took = time.monotonic() - t
        time.sleep(1.0)  # let the other rank reach its own deadline before this one leaves
        return str(e), e.peer_states, took
    return None


def test_timeout_reports_what_each_peer_is_doing():
    res = run_group(both_receive, 2)
    for r, (msg, states, took) in enumerate(res):
        other = 1 - r
        assert f"rank {other}: in broadcast(root={r}) #0" in msg, msg
        assert states[other].startswith(f"in broadcast(root={r}) #0")
        assert took < 3.5


def both_receive_rank0_asks_late(g):
    """As both_receive, but rank 0 asks nobody early: rank 1 asks at 1 s, finds the
    mismatch and tells rank 0 before rank 0 has asked anything."""
    if g.rank == 0:
        monkeypatch_first_probe(60.0)
    t = time.monotonic()
    try:
        g.broadcast(None, src=1 - g.rank, timeout=30.0)
    except ctrlcomm.CollectiveTimeoutError as e:
        took = time.monotonic() - t
        time.sleep(1.0)
        return str(e), e.peer_states, took
    return None


def test_a_rank_told_of_a_mismatch_before_it_asked_says_what_the_teller_was_doing():
    # (before: "rank 1: not asked (told before this rank asked)", where it raced the other
    # rank's question: test_timeout_reports_what_each_peer_is_doing failed so once in CI)
    res = run_group(both_receive_rank0_asks_late, 2)
    msg, states, took = res[0]
    assert "rank 1: in broadcast(root=0) #0" in msg, msg
    assert states[1].startswith("in broadcast(root=0) #0"), states
    assert "rank 1 called broadcast(root=0)" in msg, msg
    assert took < 15.0, took  # (told at rank 1's first question, 1 s in; not at 30 s)
    msg1, states1, _ = res[1]
    assert states1[0].startswith("in broadcast(root=1) #0"), states1


def monkeypatch_first_probe(seconds):
    """(In a rank's own process: its collectives ask the ranks they wait for after this.)"""
    import importlib
    import pkgutil

    import ctrlcomm._core as core

    for m in pkgutil.iter_modules(core.__path__):  # (each module of the core that reads it)
        mod = importlib.import_module(f"ctrlcomm._core.{m.name}")
        if hasattr(mod, "FIRST_PROBE"):
            mod.FIRST_PROBE = seconds


def unseen_mismatch(g, kind, late, long):
    """Ranks in different calls at one seq where no rank gets a message of the other call:
    every rank waits. A waiting rank asks the ranks it waits for which call they are in, 1 s
    into its call (``long``: 30 s timeouts, found long before the deadline), or (early
    questions turned off) shortly before its deadline (1.2 s for rank 0, 1.5 s for the others:
    rank 0 asks first, unless it enters late); the first
    to hear of another call at its seq raises an error that is both a mismatch and a timeout,
    naming the calls, and tells the others; each rank that waits raises it too. ``late``:
    rank 0 enters 0.6 s after the others."""
    r = g.rank
    if not long:  # no early question: only the one shortly before the deadline
        monkeypatch_first_probe(1e9)
    t0 = time.monotonic()
    if late and r == 0:
        time.sleep(0.6)
    t = 30.0 if long else 1.2 if r == 0 and not late else 1.5
    try:
        if kind == "all_reduce_vs_broadcast":
            out = g.all_reduce(1, timeout=t) if r == 0 else g.broadcast(None, src=0, timeout=t)
        else:  # gather: rank 0 names itself the destination, the others rank 1
            out = g.gather(r, dst=0 if r == 0 else 1, timeout=t)
    except ctrlcomm.CollectiveTimeoutError as e:
        took = time.monotonic() - t0
        time.sleep(max(0.0, 3.0 - took))  # stay until every rank has raised
        return ("timeout", isinstance(e, ctrlcomm.MismatchError), str(e), e.op, e.seq,
                e.waiting_for, e.peer_states, took)
    # rank 2 of the gather sent to its destination (rank 1) and returned; waiting in a recv
    # it answers the others that it returned from gather(root=1) #0, then hears of the
    # mismatch: the group is broken
    try:
        g.recv(src=0, timeout=2.5)
    except ctrlcomm.GroupBrokenError as e:
        return ("returned", out, type(e.__cause__).__name__, str(e))
    return ("returned", out, None, None)


@pytest.mark.parametrize("long", [True, False], ids=["asked_early", "asked_at_deadline"])
@pytest.mark.parametrize("late", [False, True], ids=["together", "rank0_late"])
@pytest.mark.parametrize("kind", ["all_reduce_vs_broadcast", "gather_destinations"])
def test_a_mismatch_no_rank_receives_is_found_by_asking_and_raised_as_both_errors(
        kind, late, long):
    res = run_group(unseen_mismatch, 3, kind, late, long)
    waiting = [0, 1, 2] if kind == "all_reduce_vs_broadcast" else [0, 1]
    for r in waiting:
        what, is_mismatch, msg, op, seq, waited_for, states, took = res[r]
        assert what == "timeout" and is_mismatch, (r, res[r])
        if long:  # at the first question, 1 s into the call: long before the 30 s deadline
            assert 0.9 < took < 4.0, (r, took)
        else:  # at the first deadline (rank 0's, or the others'), not before, not after
            assert (1.0 if not late else 1.3) < took < 2.0, (r, took)
        assert seq == 0 and "mismatch" in msg and waited_for, (r, msg)
        if kind == "all_reduce_vs_broadcast":
            assert "all_reduce(op='sum')" in msg and "broadcast(root=0)" in msg, (r, msg)
        else:
            assert "gather(root=0)" in msg and "gather(root=1)" in msg, (r, msg)
        if not late and not long:  # rank 0 asked its peers first, and told them
            if r == 0:
                assert not any(states[s].startswith("did not answer") for s in waited_for)
            else:
                assert "(reported by rank 0, which asked the ranks it waited for)" in msg, \
                    (r, msg)
    if kind == "gather_destinations":
        # rank 2 returned None (it sent to its destination) and was then told
        assert res[2] == ("returned", None, "MismatchError", res[2][3]), res[2]
        if not late and not long:  # its answer from the recv: it returned from gather(root=1)
            # (the error names the ranks whose answers it had read when it raised)
            assert "rank 1 called gather(root=1)" in res[0][2] \
                or "rank 2 called gather(root=1)" in res[0][2], res[0][2]


def unseen_mismatch_awaited(g):
    """As unseen_mismatch (all_reduce on rank 0, broadcast on the others, 30 s timeouts), with
    awaited calls, while another task of the loop runs: the question 1 s in comes from the
    asyncio driver too, and the loop runs meanwhile."""
    async def main():
        beats: list[float] = []  # when the other task ran

        async def beat():
            for _ in range(2000):
                beats.append(time.monotonic())
                await asyncio.sleep(0.05)

        other = asyncio.create_task(beat())
        t0 = time.monotonic()
        try:
            if g.rank == 0:
                await g.aio.all_reduce(1, timeout=30)
            else:
                await g.aio.broadcast(None, src=0, timeout=30)
        except ctrlcomm.MismatchTimeoutError as e:
            return time.monotonic() - t0, len(beats), str(e)
        finally:
            other.cancel()
        return "no error"

    out = asyncio.run(main())
    time.sleep(1.0)  # (until every rank has raised)
    return out


def test_an_unseen_mismatch_is_found_by_asking_in_awaited_calls_too():
    for took, beats, msg in run_group(unseen_mismatch_awaited, 3):
        assert 0.9 < took < 4.0 and beats >= 10, (took, beats, msg)
        assert "all_reduce(op='sum')" in msg and "broadcast(root=0)" in msg, msg


def late_rank_is_not_a_mismatch(g):
    """A rank that is merely late makes a plain timeout, not a mismatch: here it waits in a
    recv after the barrier (#0) while rank 0 waits for it in all_reduce #1 (it answers
    that it returned from barrier #0)."""
    if g.rank == 1:
        g.barrier(timeout=5)
        # (its own timeout, or, first, rank 0's word that its all_reduce timed out waiting
        # for this rank: nothing can come from rank 0 then)
        with pytest.raises((ctrlcomm.CollectiveTimeoutError, ctrlcomm.PeerLostError)):
            g.recv(src=0, timeout=1.5)
        return None
    g.barrier(timeout=5)
    try:
        g.all_reduce(1, timeout=1.0)
    except ctrlcomm.CollectiveTimeoutError as e:
        time.sleep(1.0)  # (closing now would end rank 1's recv with PeerLostError)
        return isinstance(e, ctrlcomm.MismatchError), e.peer_states
    return "no error"


def test_a_late_rank_is_a_timeout_not_a_mismatch():
    is_mismatch, states = run_group(late_rank_is_not_a_mismatch, 2)[0]
    assert not is_mismatch
    assert states[1].startswith("in recv(src=0, tag=0)"), states


def mismatched_ops(g):
    try:
        if g.rank == 0:
            g.all_reduce(1, timeout=5)
        else:
            g.all_gather("x", timeout=5)  # both send and both receive: both can tell
    except ctrlcomm.MismatchError as e:
        return "mismatch", str(e)
    except ctrlcomm.CollectiveTimeoutError as e:
        return "timeout", str(e)
    return "ok", None


def test_mismatch_raises_at_once_describing_both_sides():
    t = time.monotonic()
    res = run_group(mismatched_ops, 2)
    assert time.monotonic() - t < 4.5  # at once, not after the 5 s deadline
    for kind, msg in res:
        assert kind == "mismatch", res
        assert "all_reduce(op='sum')" in msg and "all_gather" in msg


def different_reduction_ops(g):
    try:
        g.all_reduce(1, op="max" if g.rank == 0 else "sum", timeout=5)
    except ctrlcomm.MismatchError as e:
        return str(e)
    return None


def test_mismatch_of_reduction_op():
    for msg in run_group(different_reduction_ops, 2):
        assert msg and "op='max'" in msg and "op='sum'" in msg


def roots_differ(g, op):
    """Rank 0 names itself the root, the others rank 1: each can return without waiting for
    the other root, so the mismatch shows only after the call, in the next one."""
    src = 0 if g.rank == 0 else 1
    t = time.monotonic()
    try:
        # (rank 2, waiting for rank 1, may get rank 0's message first: it raises at once)
        if op == "broadcast":
            g.broadcast(f"from {g.rank}", src=src, timeout=10)
        else:
            g.scatter([f"{g.rank}->{i}" for i in range(g.world_size)], src=src, timeout=10)
        g.all_reduce(1, timeout=10)
        g.barrier(timeout=10)
    except ctrlcomm.MismatchError as e:
        return "mismatch", str(e), time.monotonic() - t, g.broken
    except ctrlcomm.GroupBrokenError as e:
        return "broken", repr(e.__cause__), time.monotonic() - t, g.broken
    return "no error", None, None, g.broken


@pytest.mark.parametrize("op", ["broadcast", "scatter"])
def test_ranks_naming_different_roots_raise_a_mismatch_instead_of_going_on(op):
    res = run_group(roots_differ, 3, op)
    for r, (kind, msg, took, broken) in enumerate(res):
        assert kind in ("mismatch", "broken") and broken, (r, res)
        assert "MismatchError" in msg or kind == "mismatch", (r, msg)
        assert "root=0" in msg and "root=1" in msg, (r, msg)
        assert took < 8, (r, took)  # not the 10 s deadline of a rank left waiting


def both_roots_then_all_reduce(g):
    """Each rank of two names itself the broadcast's root: both send and return (unless the
    look at what has come in, which a root makes before it sends, finds the other's message
    already: then the broadcast raises). Rank 1 enters the next call late, when rank 0's
    broadcast and all_reduce messages are both waiting: it reads them together, and the
    all_reduce, whose own messages are all in, still raises the mismatch found in the same
    read (not only the call after it)."""
    try:
        g.broadcast(f"from {g.rank}", src=g.rank, timeout=10)
    except ctrlcomm.MismatchError as e:
        return "mismatch", str(e)
    if g.rank == 1:
        time.sleep(0.3)
    try:
        out = g.all_reduce(1, timeout=10)
    except ctrlcomm.MismatchError as e:
        return "mismatch", str(e)
    return "returned", out


def test_a_mismatch_found_late_fails_the_call_in_progress_however_the_reads_fall():
    for r, (kind, msg) in enumerate(run_group(both_roots_then_all_reduce, 2)):
        assert kind == "mismatch", (r, kind, msg)
        assert "broadcast(root=0)" in msg and "broadcast(root=1)" in msg, (r, msg)


def reduction_ops_differ(g):
    """Only rank 0 sees the mismatch (the star's root: rank 1 and 2 send to it and wait):
    it must tell them, not leave them waiting out their deadline."""
    t = time.monotonic()
    try:
        g.all_reduce(1, op="sum" if g.rank == 0 else "max", timeout=20)
    except ctrlcomm.MismatchError as e:
        return str(e), time.monotonic() - t
    return "no error", None


def test_a_mismatch_one_rank_finds_fails_every_rank_at_once():
    for r, (msg, took) in enumerate(run_group(reduction_ops_differ, 3)):
        assert "op='sum'" in msg and "op='max'" in msg, (r, msg)
        assert took < 10, (r, took)


def bad_arguments_leave_the_group_working(g):
    r, n = g.rank, g.world_size
    errors = []
    for call in [
        lambda: g.broadcast(1, src=n),
        lambda: g.broadcast(1, src=-1),
        lambda: g.gather(1, dst="0"),
        lambda: g.all_reduce(1, op="avg"),
        lambda: g.all_reduce("text", op="sum"),
        lambda: g.all_reduce(1.5, op="band"),
        # objects known wrong at one rank only (a scatter's root; one all_to_all rank): it
        # takes part with the failure in their place, and every rank raises it
        lambda: g.scatter([1] * (n + 1) if r == 0 else None, src=0),
        lambda: g.all_to_all([1] if r == 1 else [r] * n),
        lambda: g.send(1, dst=n),  # (dst=r is a send to itself, as MPI allows)
        lambda: g.recv(src=n + 3),
        lambda: g.barrier(timeout=0),
        lambda: g.all_reduce(1, timeout=-1),
    ]:
        try:
            call()
        except ctrlcomm.InvalidArgumentError as e:
            errors.append(str(e))
    return errors, g.all_reduce(r), g.stats()["state"]


def test_bad_arguments_are_clear_and_harmless():
    res = run_group(bad_arguments_leave_the_group_working, 3)
    for r, (errors, total, state) in enumerate(res):
        assert len(errors) == 12
        assert all(f"rank {r}" in e or "timeout" in e for e in errors), errors
        assert "src=3 is not a rank" in errors[0]
        assert "'avg'" in errors[3] and "4 objects" in errors[6]
        assert "scatter on rank 0" in errors[6] and "all_to_all on rank 1" in errors[7]
        assert total == 3 and state == "open"


def reduction_error_everywhere(g):
    vals = (1, 2) if g.rank != 1 else (1, 2, 3)
    try:
        g.all_reduce(vals)
    except ctrlcomm.ReductionError as e:
        return str(e), g.all_reduce(1)
    return None


@pytest.mark.parametrize("n", [2, 5])
def test_reduction_error_raised_on_every_rank_group_still_works(n):
    for msg, after in run_group(reduction_error_everywhere, n):
        assert "different lengths" in msg
        assert after == n


def a_reduction_that_fails_at_one_rank(g, bad):
    out = []
    for call in (lambda v: g.all_reduce(v), lambda v: g.reduce(v, dst=g.size - 1)):
        try:
            got = call([1, 2] if g.rank != bad else [1, 2, 3])
        except ctrlcomm.ReductionError as e:
            got = (str(e), e.ranks)
        out.append(got)
    return out, g.all_reduce(g.rank)


@pytest.mark.parametrize(("n", "codec", "bad"), [(2, "pickle", 1), (3, "pickle", 2), (5, "msgpack", 3),
                                                 pytest.param(9, "msgpack", 6, marks=pytest.mark.slow)])
def test_a_reduction_error_names_the_ranks_whose_operands_did_not_combine(n, codec, bad):
    # the flat plan (2 ranks), the star (3 to 8: rank 0 combines and sends the failure on,
    # encoded), recursive doubling (9); every rank names the same ranks, among them the one
    # whose operand was odd, and the group still works
    res = run_group(a_reduction_that_fails_at_one_rank, n, bad, group_kwargs={"codec": codec})
    for r, (out, after) in enumerate(res):
        assert after == n * (n - 1) // 2
        (msg, ranks), red = out
        assert bad in ranks and len(set(ranks)) == len(ranks) >= 2, (r, msg, ranks)
        where = msg.split("combining the operand", 1)[1].split(":", 1)[0]  # (ranks a-b, c)
        assert str(bad) in where.replace("-", " ").replace(",", " ").replace("'s", " ").split() \
            or any(int(a) < bad < int(b) for a, b in re.findall(r"(\d+)-(\d+)", where)), msg
        assert "different lengths" in msg
        if ctrlcomm._algo.choose("all_reduce", n).__name__ in ("all_reduce_flat",
                                                                "all_reduce_star"):
            # a fold in rank order: the ranks before the odd one, and it
            assert ranks == list(range(bad + 1)), ranks  # (a list, as PeerLostError's)
        assert msg.split(": ", 1)[1] == res[0][0][0][0].split(": ", 1)[1]  # (but "on rank r")
        if r == n - 1:
            assert red[1] and bad in red[1] and "different lengths" in red[0], red
        else:
            assert red is None
    assert all(out[0][1] == res[0][0][0][1] for out, _ in res)


def arrays_of_other_shapes(g):
    import numpy as np

    out = []
    for mine in (np.ones(3) if g.rank != 1 else np.ones((2, 3)),  # (would broadcast)
                 np.ones(4) if g.rank != 2 else 1.0):
        try:
            out.append(g.all_reduce(mine).tolist())
        except ctrlcomm.ReductionError as e:
            out.append(str(e))
    return out, g.all_reduce(np.ones(2)).tolist()


def test_arrays_of_other_shapes_fail_a_reduction_on_every_rank():
    # (as lists of other lengths do, not a result of numpy's broadcasting shape)
    pytest.importorskip("numpy")
    for r, (errors, after) in enumerate(run_group(arrays_of_other_shapes, 3)):
        assert len(errors) == 2 and all("different shapes" in e for e in errors), (r, errors)
        assert "(2, 3)" in errors[0] and "a scalar" in errors[1], errors
        assert after == [3.0, 3.0]


def one_rank_with_a_bad_operand(g, codec_note):
    """Only rank 0's operand cannot be summed: every rank must fail that call (not rank 0
    alone, which would leave the others waiting, or pair them with its next call)."""
    out = []
    for call in (lambda v: g.all_reduce(v, timeout=10),
                 lambda v: g.reduce(v, dst=1, timeout=10)):
        try:
            got = call("x" if g.rank == 0 else 1)
        except ctrlcomm.ReductionError as e:
            got = (type(e).__name__, isinstance(e, ctrlcomm.InvalidArgumentError), str(e))
        out.append(got)
        out.append(g.all_reduce(100, timeout=10))  # in step, and right
    return out


@pytest.mark.parametrize("codec", ["pickle", "msgpack"])
def test_one_ranks_bad_operand_fails_the_call_on_every_rank_and_the_group_goes_on(codec):
    res = run_group(one_rank_with_a_bad_operand, 3, codec, group_kwargs={"codec": codec})
    for r, (ar, after1, red, after2) in enumerate(res):
        name, invalid, msg = ar
        assert name == "OperandError" and invalid, (r, ar)
        assert "rank 0" in msg and "'x'" in msg, (r, msg)
        assert after1 == after2 == 300, (r, res[r])
        # reduce: the destination (rank 1) gets the failure; so does rank 0, whose operand
        # it was; rank 2 gets no result, and nothing to raise
        if r == 2:
            assert red is None, red
        else:
            assert red[0] == "OperandError" and "'x'" in red[2], (r, red)


Stats = namedtuple("Stats", "queued running")  # (module level: pickled by reference)


def one_rank_with_an_unencodable_operand(g):
    import numpy as np

    try:  # msgpack takes numbers, not numpy scalars: only rank 0 can tell
        got = g.all_reduce(np.int64(3) if g.rank == 0 else 1, timeout=10)
    except ctrlcomm.OperandError as e:
        got = str(e)
    return got, g.all_reduce(10, timeout=10)


def test_one_ranks_unencodable_operand_fails_the_call_on_every_rank():
    for got, after in run_group(one_rank_with_an_unencodable_operand, 2,
                                group_kwargs={"codec": "msgpack"}):
        assert "rank 0" in got and "int64" in got, got
        assert after == 20


def reduce_named_tuples(g):
    s = g.all_reduce(Stats(g.rank, 1), op="sum")
    m = g.all_reduce([Stats(g.rank, -g.rank)], op="max")
    return type(s).__name__, tuple(s), type(m[0]).__name__, tuple(m[0])


def test_named_tuples_reduce_to_named_tuples():
    for out in run_group(reduce_named_tuples, 3):
        assert out == ("Stats", (3, 3), "Stats", (2, 0))


def recv_timeout_keeps_group(g):
    if g.rank == 0:
        try:
            g.recv(1, timeout=0.3)
        except ctrlcomm.CollectiveTimeoutError as e:
            first = (str(e), e.op, e.waiting_for)
        g.barrier()
        return first, g.recv(1)
    g.barrier()
    g.send("late", 0)
    return None


def test_recv_timeout_leaves_group_usable():
    (msg, op, waiting_for), late = run_group(recv_timeout_keeps_group, 2)[0]
    assert "recv(src=1, tag=0)" in msg and "[1]" in msg
    # (.op the operation, as a collective's is: before, "recv(src=1, tag=0)")
    assert op == "recv" and waiting_for == [1]
    assert late == "late"


def band_of_floats(g):
    import numpy as np
    import torch

    out = []
    for v in (1.5, np.float64(1.5), np.ones(2), torch.ones(2), np.ones(2, dtype=np.int8),
              torch.ones(2, dtype=torch.bool), np.array([3, 2**70], dtype=object)):
        try:
            r = g.all_reduce(v, op="band")
            out.append(("ok", type(r).__name__))
        except ctrlcomm.OperandError as e:
            out.append(("OperandError", f"rank {g.rank}" in str(e)))
    return out, g.all_reduce(1)


@pytest.mark.parametrize("n", [1, 2])
def test_band_of_a_float_array_is_an_operand_error_at_every_world_size(n):
    """(before: returned as it was at world size 1, a ReductionError blaming the combining
    of two ranks' operands at 2)"""
    for out, after in run_group(band_of_floats, n):
        assert out[:4] == [("OperandError", True)] * 4, out
        assert [k for k, _ in out[4:]] == ["ok", "ok", "ok"], out  # (object arrays: ints)
        assert after == n


def ranks_with_different_algorithms(g):
    """CTRLCOMM_ALGO set unlike on different ranks: rank 0 runs the flat all_reduce, the
    others the star. Neither takes the other's messages for its own: all time out, nobody
    returns a wrong sum."""
    from ctrlcomm import _algo

    _algo.OVERRIDES["all_reduce"] = "flat" if g.rank == 0 else "star"
    _algo.choose.cache_clear()
    try:
        out = g.all_reduce(g.rank + 1, timeout=1.0)
    except ctrlcomm.CollectiveTimeoutError:
        out = "timed out"
    g.store.set(f"test/algo/{g.rank}", "1")  # nobody closes before all have timed out
    g.store.wait([f"test/algo/{r}" for r in range(g.world_size)], timeout=60)
    return out


def test_ranks_with_different_algorithms_time_out_instead_of_mixing_messages():
    assert run_group(ranks_with_different_algorithms, 3) == ["timed out"] * 3


def both_cancelled(g):
    """Wait until both ranks cancelled their call: a rank that closes first would end the
    other's call with PeerLostError before it is cancelled."""
    g.store.set(f"test/cancelled/{g.rank}", "1")
    g.store.wait(["test/cancelled/0", "test/cancelled/1"], timeout=60)


def awaited_short_timeout_after_long_one(g):
    """An awaited call's deadline holds whatever deadline the call before it had: a short
    one after a long one, and a long one after a short one."""

    async def main():
        if g.rank == 1:
            await asyncio.sleep(0.3)  # rank 0 waits in this barrier with a 60 s deadline
        await g.aio.barrier(timeout=60)
        if g.rank == 1:
            await g.aio.recv(0, tag=1, timeout=60)
            return None
        t = time.monotonic()
        try:
            await g.aio.recv(1, tag=5, timeout=0.5)  # nobody sends: times out at 0.5 s
        except ctrlcomm.CollectiveTimeoutError:
            short = time.monotonic() - t
        await asyncio.sleep(0.3)
        await g.aio.send("go", 1, tag=1)  # rank 1 waited with a timer set after the short one
        return short

    return asyncio.run(main())


def test_awaited_deadlines_after_other_deadlines():
    short = run_group(awaited_short_timeout_after_long_one, 2)[0]
    assert 0.45 < short < 3.0, short


def cancel_then_use(g):
    async def main():
        if g.rank == 0:
            task = asyncio.ensure_future(g.aio.all_reduce(1))
            await asyncio.sleep(0.4)  # (after rank 1's cancel: this one tells rank 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            try:
                await g.aio.barrier()
            except ctrlcomm.GroupBrokenError as e:
                out = "broken", str(e)
            else:
                out = "not broken", ""
            both_cancelled(g)
            return out
        # recv cancel leaves the group usable
        task = asyncio.ensure_future(g.aio.recv(0, tag=3))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        state = g.stats()["state"]
        both_cancelled(g)
        return "ok", state

    return asyncio.run(main())


def test_cancelled_collective_breaks_cancelled_recv_does_not():
    (k0, m0), (k1, s1) = run_group(cancel_then_use, 2)
    assert k0 == "broken" and "cancelled" in m0
    assert k1 == "ok" and s1 == "open"


def cancelled_while_others_wait(g):
    """Rank 0 cancels its awaited all_reduce (asyncio.wait_for) and goes on; the others,
    in the same call with a 60 s deadline, are told at once."""
    async def main():
        if g.rank == 0:
            try:
                await asyncio.wait_for(g.aio.all_reduce(1), 0.3)
            except asyncio.TimeoutError:
                return "cancelled"
        await asyncio.sleep(0.5)
        t = time.monotonic()
        try:
            await g.aio.all_reduce(1, timeout=60)
        except ctrlcomm.PeerLostError as e:
            return e.ranks, str(e), time.monotonic() - t

    out = asyncio.run(main())
    g.store.set(f"test/done/{g.rank}", "1")  # rank 0 stays until the others know
    g.store.wait([f"test/done/{r}" for r in range(g.world_size)], timeout=50)
    return out


def test_a_cancelled_collective_tells_the_ranks_waiting_in_it():
    res = run_group(cancelled_while_others_wait, 3, timeout=45)
    assert res[0] == "cancelled"
    # (told, not at their 60 s deadline: the run's 45 s would have ended first)
    for ranks, text, _ in res[1:]:
        assert ranks == [0] and "cancelled on rank 0" in text, text


def cancelled_before_it_began(g, how, op):
    """Rank 0's awaited collective is cancelled before its coroutine first runs (a deadline
    already spent, or a task cancelled as it is made); both ranks then call it again."""
    call = {"all_gather": lambda x: g.aio.all_gather(x, timeout=20),
            "broadcast": lambda x: g.aio.broadcast(x, src=0, timeout=20),
            "barrier": lambda x: g.aio.barrier(timeout=20)}[op]

    async def main():
        out = []
        if g.rank == 0:
            if how == "wait_for":
                try:
                    await asyncio.wait_for(call("first"), 0)
                except asyncio.TimeoutError:
                    out.append("timed out")
            else:
                task = asyncio.ensure_future(call("first"))
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    out.append("cancelled")
            out.append(g.broken)
        else:
            try:
                out.append(await call("first"))
            except ctrlcomm.PeerLostError as e:
                out.append((e.ranks, "(before it began)" in str(e)))
        try:
            out.append(await call("second"))
        except ctrlcomm.CtrlcommError as e:
            out.append(type(e).__name__)
        return out

    res = asyncio.run(main())
    both_cancelled(g)  # (rank 0 stays until rank 1 knows)
    return res


@pytest.mark.parametrize("how", ["wait_for", "cancel"])
@pytest.mark.parametrize("op", ["all_gather", "broadcast", "barrier"])
def test_an_awaited_collective_cancelled_before_it_began_breaks_the_group(how, op):
    # (found in review: its coroutine was closed before its body ran, so nothing knew of
    # the call: the group stayed open, and rank 0's next call paired with rank 1's first:
    # all_gather gave ["second", "first"] on both ranks)
    res = run_group(cancelled_before_it_began, 2, how, op, timeout=60)
    assert res[0] == ["timed out" if how == "wait_for" else "cancelled", True,
                      "GroupBrokenError"], res
    assert res[1] == [([0], True), "PeerLostError"], res


def cancelled_before_it_began_while_another_call_runs(g, holder):
    """Rank 0: task A (an awaited all_gather, or a recv) waits for rank 1; task B's barrier
    is cancelled as it is made. Behind an awaited collective of its event loop B would
    have waited its turn and been made (as rank 1's, which gathered both, is): the group
    breaks once A has ended. Beside a recv it would have run at once (point-to-point calls
    hold no collective back), and the others may make it: the group breaks at once, the
    recv raises, and rank 1 is told."""
    async def main():
        if g.rank == 1:
            await asyncio.sleep(0.5)
            if holder == "recv":
                try:
                    g.send("A", 0)
                    return "sent", g.broken
                except ctrlcomm.PeerLostError:
                    return "told", g.broken
            a = await g.aio.all_gather("A", timeout=20)
            try:
                await g.aio.barrier(timeout=20)
            except ctrlcomm.PeerLostError:
                pass
            return a, g.broken
        a = asyncio.ensure_future(g.aio.recv(1, timeout=20) if holder == "recv"
                                  else g.aio.all_gather("A", timeout=20))
        await asyncio.sleep(0.1)  # (A waits for rank 1)
        b = asyncio.ensure_future(g.aio.barrier(timeout=20))
        b.cancel()
        with pytest.raises(asyncio.CancelledError):
            await b
        try:
            got = await a
        except ctrlcomm.GroupBrokenError:
            got = "broken"
        return got, g.broken

    out = asyncio.run(main())
    try:
        return out, g.all_reduce(1, timeout=20)
    except ctrlcomm.GroupBrokenError as e:
        return out, type(e).__name__


@pytest.mark.parametrize("holder", ["collective", "recv"])
def test_an_awaited_call_cancelled_before_it_began_behind_another(holder):
    got = run_group(cancelled_before_it_began_while_another_call_runs, 2, holder, timeout=60)
    if holder == "recv":
        assert got[0] == (("broken", True), "GroupBrokenError"), got
        assert got[1] == (("told", True), "PeerLostError"), got
    else:
        assert got[0] == ((["A", "A"], True), "GroupBrokenError"), got
        assert got[1] == ((["A", "A"], True), "PeerLostError"), got


def test_an_awaited_collective_never_awaited_is_warned_of_as_an_async_defs_coroutine():
    with ctrlcomm.Group.create("127.0.0.1", free_port(), 0, 1, timeout=5) as g:
        with pytest.warns(RuntimeWarning, match="coroutine 'AioGroup.barrier' was never awaited"):
            g.aio.barrier()  # (dropped at once: no reference is left)
        assert asyncio.iscoroutinefunction(g.aio.all_gather)
        assert asyncio.run(g.aio.all_gather(1)) == [1]


def times_out_while_another_is_late(g, api):
    """Rank 0's barrier times out (1 s) while rank 1 is busy; rank 1 comes 3 s later, with
    15 s deadlines: told at once that rank 0's group broke, in that barrier (its part came
    first) or the next. (It waited its whole 15 s there, then said rank 0 was "not in a
    ctrlcomm call, or stuck"; a vLLM or Megatron deadline is 300 s.)"""
    if api == "vllm":
        from ctrlcomm import StatelessProcessGroup

        pg = StatelessProcessGroup(g)
        barrier = pg.barrier
    else:
        barrier = g.barrier
    barrier(timeout=15)
    if g.rank == 0:
        with pytest.raises(ctrlcomm.CollectiveTimeoutError):
            barrier(timeout=1)
        out = None
    else:
        time.sleep(3)
        t = time.monotonic()
        try:
            barrier(timeout=15)
            barrier(timeout=15)
            out = "no error"
        except ctrlcomm.PeerLostError as e:
            out = e.ranks, str(e), time.monotonic() - t
    g.store.set(f"test/done/{g.rank}", "1")  # (rank 0 stays until rank 1 has its answer)
    g.store.wait(["test/done/0", "test/done/1"], timeout=50)
    return out


@pytest.mark.parametrize("api", ["group", "vllm"])
def test_a_timed_out_collective_tells_the_others_its_group_broke(api):
    ranks, text, took = run_group(times_out_while_another_is_late, 2, api, timeout=45)[1]
    assert ranks == [0] and took < 5, (ranks, text, took)
    assert "aborted the group" in text and "timed out after 1 s on rank 0" in text, text


def lost_while_in_another_call(rank, size, port):
    """Rank 2 exits; rank 0, in a barrier, finds it gone and tells the others; rank 1, in a
    broadcast from rank 2, learns it from rank 0's word."""
    import os

    from ctrlcomm import StatelessProcessGroup

    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, size, store_timeout=30)
    pg.barrier()
    if rank == 2:
        time.sleep(1.0)
        os._exit(3)
    try:
        if rank == 0:
            pg.barrier()
        else:
            pg.broadcast_obj(None, src=2)
    except ctrlcomm.PeerLostError as e:
        return e.ranks, str(e)
    return None


def test_a_lost_peer_reported_by_another_rank_is_raised_naming_this_ranks_own_call():
    """(rank 1 raised rank 0's report as it was: "group 's': rank(s) [2] lost (reported by
    rank 0): barrier #1 ... cannot complete on rank 0: ...", naming rank 0's call only)"""
    res = run_ranks(lost_while_in_another_call, 3, free_port(), timeout=60, may_die=(2,))
    assert res[0][0] == [2] and res[0][1].startswith("barrier #1 on group"), res[0]
    assert res[1][0] == [2], res[1]
    assert res[1][1].startswith("broadcast_obj(src=2) on group 'stateless' cannot complete "
                                "on rank 1: "), res[1]


def interrupted_while_others_wait(g):
    """Rank 1's blocking all_reduce, waiting for rank 0, is interrupted (Ctrl-C, caught:
    the process goes on); rank 0, coming later, with 60 s deadlines, is told at once."""
    import os
    import signal
    import threading

    if g.rank == 1:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            g.all_reduce(1, timeout=60)
        except KeyboardInterrupt:
            pass
        try:
            g.barrier()
        except ctrlcomm.GroupBrokenError as e:  # not ConcurrentUseError: the call ended
            out = ("broken", str(e))
    else:
        time.sleep(1.5)
        try:  # rank 1's part is here already: this call may complete; the next cannot
            g.all_reduce(1, timeout=60)
            g.barrier(timeout=60)
        except ctrlcomm.GroupBrokenError as e:  # (a PeerLostError, or caused by one)
            lost = e if isinstance(e, ctrlcomm.PeerLostError) else e.__cause__
            out = (lost.ranks, str(e))
    g.store.set(f"test/done/{g.rank}", "1")
    g.store.wait(["test/done/0", "test/done/1"], timeout=50)
    return out


def test_an_interrupted_blocking_collective_ends_and_tells_the_others():
    res = run_group(interrupted_while_others_wait, 2, timeout=45)
    assert res[0][0] == [1] and "interrupted on rank 1" in res[0][1], res[0]
    assert res[1][0] == "broken" and "interrupted on rank 1" in res[1][1], res[1]


def gives_up_a_call_the_others_enter_later(g, how, op):
    """Rank 1 gives up its part of collective ``op`` after sending it (its awaited call
    cancelled, or a watchdog thread's abort()); the others enter that call only then, its
    part and the word that it gave up both waiting for them."""
    import threading

    args = () if op == "barrier" else (g.rank + 1,)
    if g.rank == 1:
        if how == "cancel":
            async def main():
                task = asyncio.ensure_future(getattr(g.aio, op)(*args, timeout=60))
                await asyncio.sleep(0.3)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            asyncio.run(main())
        else:
            threading.Timer(0.3, g.abort, ("watchdog",)).start()
            with pytest.raises(ctrlcomm.GroupBrokenError, match="watchdog"):
                getattr(g, op)(*args, timeout=60)
        g.store.set("test/gave-up", "1")
        out = "gave up"
    else:
        g.store.wait(["test/gave-up"], timeout=30)
        time.sleep(0.2)  # (the word is on its way: sent before the key was set)
        try:
            out = ("returned", getattr(g, op)(*args, timeout=60))
        except ctrlcomm.PeerLostError as e:
            out = ("raised", e.ranks)
    g.store.set(f"test/done/{g.rank}", "1")
    g.store.wait([f"test/done/{r}" for r in range(g.world_size)], timeout=50)
    return out


@pytest.mark.parametrize(("n", "algo"), [(2, ""), (3, "all_reduce=flat,all_gather=flat")])
@pytest.mark.parametrize("how", ["cancel", "abort"])
@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "barrier"])
def test_a_call_a_rank_gave_up_after_sending_its_part_fails_on_every_rank(
        monkeypatch, n, algo, how, op):
    """As the README says: the others raise PeerLostError naming that rank, in that call.
    (Before: where its part had come before the word, they completed the call (world 2),
    or some did and some raised (the flat plans at world 3), and raised in the next.)"""
    if algo:
        monkeypatch.setenv("CTRLCOMM_ALGO", algo)
    res = run_group(gives_up_a_call_the_others_enter_later, n, how, op, timeout=60)
    assert res[1] == "gave up"
    for r in (0, *range(2, n)):
        assert res[r] == ("raised", [1]), (r, res)


def aborted_in_a_recv(g):
    """Rank 0's watchdog aborts while rank 0 waits in a recv; rank 1 waits in a recv from
    rank 0 with a 20 s deadline."""
    import threading

    if g.rank == 0:
        threading.Timer(0.3, g.abort, ("watchdog",)).start()
        with pytest.raises(ctrlcomm.GroupBrokenError, match="watchdog"):
            g.recv(1, timeout=20)
        out = "aborted"
    else:
        t = time.monotonic()
        try:
            g.recv(0, timeout=20)
        except ctrlcomm.PeerLostError as e:
            out = (e.ranks, time.monotonic() - t)
    g.store.set(f"test/done/{g.rank}", "1")
    g.store.wait(["test/done/0", "test/done/1"], timeout=40)
    return out


def test_an_abort_while_this_rank_waits_in_a_recv_is_told_at_once():
    """(A first version of the call-numbered abort sent seq -1, the recv's: it could not be
    framed, and the word never went out: the peer waited out its deadline.)"""
    res = run_group(aborted_in_a_recv, 2, timeout=60)
    assert res[0] == "aborted"
    ranks, took = res[1]
    assert ranks == [0] and took < 10, res


def acks_then_its_store_goes(rank, size, port):
    """Rank 1's delete of its own key, after it acknowledged the table, comes late (0.5 s:
    the scheduler's say); rank 0, which hosts the store, has closed the group and exited."""
    if rank == 1:
        from ctrlcomm import StoreClient

        real = StoreClient.delete

        def late(self, key, **kw):
            time.sleep(0.5)
            return real(self, key, **kw)

        StoreClient.delete = late
    t = time.monotonic()
    g = ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="g", timeout=6)
    took = time.monotonic() - t
    g.close()
    return took


def test_a_formed_group_does_not_fail_for_a_key_it_could_not_delete():
    """(Before: that delete waited out the formation's deadline, and the rank raised a
    StoreTimeoutError though the group had formed.)"""
    took0, took1 = run_ranks(acks_then_its_store_goes, 2, free_port(), timeout=60)
    assert took1 < 3, (took0, took1)


def test_a_mark_of_an_earlier_try_that_rank_0_was_not_in_does_not_count():
    """An earlier try: rank 0 alone (it withdraws, leaving its mark); a later try: rank 1
    alone. (Before: rank 1 said rank 0 "joined and gave up", from the earlier mark.)"""
    srv = ctrlcomm.StoreServer("127.0.0.1", 0)
    try:
        for rank, missing in ((0, [1]), (1, [0])):
            with pytest.raises(ctrlcomm.FormationTimeoutError) as e:
                ctrlcomm.Group.create("127.0.0.1", srv.port, rank, 2, name="g", timeout=0.5,
                                      host_store=False)
            assert (e.value.missing, e.value.gave_up) == (missing, []), str(e.value)
    finally:
        srv.close()


def _as_under_torchrun(rank, size, port):
    """This process's environment as torchrun's worker's, its agent's store at ``port``."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(size), TORCHELASTIC_USE_AGENT_STORE="True",
                      TORCHELASTIC_RESTART_COUNT="0")
    import torch.distributed  # noqa: F401  (imported before the clocks start)


def _under_an_agent(fn, size):
    """``run_ranks(fn, size, port)`` with a TCPStore at ``port`` standing in for torchrun's
    agent's."""
    pytest.importorskip("torch")
    import datetime

    from torch.distributed import TCPStore

    port = free_port()
    agent = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=60))
    try:
        return run_ranks(fn, size, port, timeout=90)
    finally:
        del agent


def retries_from_env_under_an_agent(rank, size, port):
    """As under torchrun (its agent's TCPStore on MASTER_PORT): rank 0's first try times
    out (rank 1 comes late) and it tries again; rank 1 comes after that first try."""
    _as_under_torchrun(rank, size, port)

    if rank == 0:
        out = []
        for t in (1.0, 20.0):
            try:
                with ctrlcomm.Group.from_env(name="ctl", timeout=t) as g:
                    out.append(g.all_gather(rank))
            except ctrlcomm.FormationTimeoutError:
                out.append("timed out")
        return out
    time.sleep(2.0)
    with ctrlcomm.Group.from_env(name="ctl", timeout=20) as g:
        return g.all_gather(rank)


def test_from_env_under_torchrun_forms_when_rank_0_tries_again():
    """(Before: each try took the next number of the name: rank 1, coming late, read the
    address of rank 0's first try, whose store had given up, and timed out.)"""
    res = _under_an_agent(retries_from_env_under_an_agent, 2)
    assert res == [["timed out", [0, 1]], [0, 1]], res


def retry_together_under_an_agent(rank, size, port):
    """Under a torchrun-like agent store, world 3: ranks 0 and 1 time out (rank 2 is not
    there) and try again, rank 1 at once, rank 0 a second later; rank 2 comes then."""
    _as_under_torchrun(rank, size, port)

    out = []
    if rank == 2:
        time.sleep(2.5)
    else:
        try:
            ctrlcomm.Group.from_env(name="ctl", timeout=1.0)
        except ctrlcomm.FormationTimeoutError:
            out.append("timed out")
        if rank == 0:
            time.sleep(1.0)
    with ctrlcomm.Group.from_env(name="ctl", timeout=20) as g:
        out.append(g.all_reduce(1))
    return out


def test_from_env_under_torchrun_forms_when_ranks_try_again_at_different_moments():
    """(A first version numbered a name's groups as formed only: rank 1, trying again at
    once, read the address of rank 0's first try, and the ranks split between stores.
    Now rank 0 takes a failed try's address back, and a rank waits for another than the
    one it tried.)"""
    res = _under_an_agent(retry_together_under_an_agent, 3)
    assert res == [["timed out", 3], ["timed out", 3], [3]], res


def test_a_group_kept_only_through_its_asyncio_view_stays_open():
    """(A first version of the fix for the view's cycle closed the group as soon as the
    Group object went, though its view was kept.)"""
    import gc
    import weakref

    view = ctrlcomm.Group.create("127.0.0.1", free_port(), 0, 1, timeout=10).aio
    gc.collect()
    assert asyncio.run(view.all_reduce(5)) == 5
    ref = weakref.ref(view._group)
    del view
    assert ref() is None  # (and without the cycle collector: no cycle)


def msgpack_deeply_nested(g):
    """A tuple nested past Python's recursion limit, with msgpack (its tuple extension
    encodes by recursion): CodecError on every rank, the group in step."""
    deep = ()
    for _ in range(5000):
        deep = (deep,)
    try:
        g.all_gather(deep if g.rank == 0 else 1)
        out = "returned"
    except ctrlcomm.CodecError as e:
        out = str(e)
    return out, g.all_reduce(1), g.broken


def test_an_object_msgpack_recurses_too_deep_on_is_a_codec_error():
    """(Before: a bare RecursionError left rank 0's call before anything was sent; its next
    all_reduce paired with the other's all_gather: MismatchError.)"""
    for r, (text, total, broken) in enumerate(run_group(msgpack_deeply_nested, 2,
                                                        group_kwargs={"codec": "msgpack"})):
        assert "codec 'msgpack' cannot encode" in text and total == 2 and not broken, (r, text)


def aborts_in_its_reduction(g, awaited):
    """Rank 0's reduction callable aborts the group, inside the all_reduce, its result in."""
    def op(a, b):
        if g.rank == 0:
            g.abort("from op")
        return a + b

    out = []
    for op_ in (op, "sum"):
        try:
            out.append(asyncio.run(g.aio.all_reduce(1, op=op_, timeout=10)) if awaited
                       else g.all_reduce(1, op=op_, timeout=10))
        except ctrlcomm.GroupBrokenError as e:
            out.append(type(e).__name__)
    return out


@pytest.mark.parametrize("awaited", [False, True], ids=["blocking", "awaited"])
def test_an_abort_from_a_reduction_callable_fails_the_next_call_on_every_rank(awaited):
    """The call's result is in on both ranks: both return it, and both fail the next one.
    (A version had an awaited call, running, take the abort as if suspended: rank 0 raised
    in the call whose result rank 1 returned.)"""
    r0, r1 = run_group(aborts_in_its_reduction, 2, awaited)
    assert r0 == [2, "GroupBrokenError"] and r1 == [2, "PeerLostError"], (r0, r1)


def two_threads(g):
    if g.rank == 1:
        time.sleep(0.5)
        g.barrier()
        return None
    err = []

    def other():
        time.sleep(0.1)
        try:
            g.barrier()
        except ctrlcomm.ConcurrentUseError as e:
            err.append(str(e))

    t = threading.Thread(target=other)
    t.start()
    g.barrier()  # busy for ~0.5 s waiting for rank 1
    t.join()
    return err, g.stats()["state"]


def test_second_thread_gets_a_clear_error():
    err, state = run_group(two_threads, 2)[0]
    assert err and "busy with barrier" in err[0]
    assert state == "open"


def closed_group(g):
    g.close()
    g.close()  # idempotent
    try:
        g.barrier()
    except ctrlcomm.GroupClosedError as e:
        return str(e)


def test_closed_group_says_so():
    for msg in run_group(closed_group, 2):
        assert "closed" in msg


def peer_closed(g):
    if g.rank == 1:
        g.close()
        return None
    t = time.monotonic()
    try:
        g.recv(1, timeout=20)
    except ctrlcomm.PeerLostError as e:
        return str(e), e.ranks, time.monotonic() - t


def test_peer_that_closed_is_reported_fast():
    msg, ranks, took = run_group(peer_closed, 2)[0]
    assert ranks == [1] and "rank 1" in msg and took < 5


def sent_then_left_long_ago(g, aio):
    """Ranks 1 and 2 send (rank 2 in a broadcast too) and close; rank 0 takes it all well
    after their heartbeats stopped. (Rank 1 stays until rank 2's broadcast, which goes to
    it too, has been sent: a broadcast to a rank that closed first fails.)"""
    import asyncio

    if g.rank:
        g.send({"from": g.rank}, 0)
        if g.rank == 2:
            g.broadcast(("config", 2), src=2)
            g.store.set("broadcast", "sent")
        else:
            g.store.wait(["broadcast"], timeout=30)
        return None
    time.sleep(2.5)  # (its own work: past liveness_timeout, the peers long gone)
    got = []
    for src in (1, 2):
        got.append(asyncio.run(g.aio.recv(src)) if aio else g.recv(src))
    got.append(g.broadcast(None, src=2))
    try:
        g.recv(1, timeout=5)
    except ctrlcomm.PeerLostError as e:
        got.append(str(e))
    return got


@pytest.mark.parametrize("transport", ["tcp", "zmq"])
@pytest.mark.parametrize("aio", [False, True], ids=["blocking", "awaited"])
def test_what_a_peer_sent_before_it_left_is_taken_however_late(transport, aio):
    # as from vLLM's store, where a sent object outlives its sender: workers send their
    # results and exit, the coordinator collects them later. Before, a recv made after the
    # sender's heartbeats had stopped for liveness_timeout declared it lost, what it had sent
    # unread (rank 1's connection, made while rank 0 was away, was accepted but not read)
    got = run_group(sent_then_left_long_ago, 3, aio, group_kwargs={
        "transport": transport, "liveness_timeout": 1.0, "heartbeat_interval": 0.2})[0]
    assert got[:3] == [{"from": 1}, {"from": 2}, ("config", 2)], got
    # and the loss that follows says why: its goodbye, read then, over the silence
    assert "rank 1 closed the group" in got[3], got


def flood_then_left(g, n):
    """Rank 1 sends n small messages (tag 1), then the one rank 0 waits for (tag 2), and
    closes; rank 0 asks for it well after rank 1's heartbeats stopped."""
    if g.rank == 1:
        for i in range(n):
            g.send(i, 0, tag=1)
        g.send("wanted", 0, tag=2)
        return None
    time.sleep(2.5)
    return g.recv(1, tag=2, timeout=30), len(g._core.p2p.get((1, 1), ()))


@pytest.mark.parametrize("transport", ["tcp", "zmq"])
def test_what_a_peer_sent_behind_a_flood_before_it_left_is_taken(transport):
    # the reads before a loss is raised go on while they take anything (before: eight
    # drains, each cut after 5 ms of a flood, read 36,175 of 50,000; PeerLostError)
    n = 50_000
    assert run_group(flood_then_left, 2, n, timeout=120, group_kwargs={
        "transport": transport, "liveness_timeout": 1.0, "heartbeat_interval": 0.2})[0] \
        == ("wanted", n)


# ------------------------------------------------------------------------- formation


def test_invalid_rank_and_world_size():
    port = free_port()
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="rank 4 is out of range"):
        ctrlcomm.Group.create("127.0.0.1", port, 4, 4)
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="world_size must be >= 1"):
        ctrlcomm.Group.create("127.0.0.1", port, 0, 0)
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="rank must be an int"):
        ctrlcomm.Group.create("127.0.0.1", port, "0", 2)
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="codec"):
        ctrlcomm.Group.create("127.0.0.1", port, 0, 1, codec="json")
    # (a bool is an int to Python; it was taken as rank 1, or a world of 1)
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="rank must be an int, got True"):
        ctrlcomm.Group.create("127.0.0.1", port, True, 2)
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="world_size must be an int"):
        ctrlcomm.StatelessProcessGroup.create("127.0.0.1", port, 0, True)


@pytest.mark.parametrize("setting", ["liveness_timeout", "heartbeat_interval"])
@pytest.mark.parametrize("value", ["x", [1], 0, -1.0, float("nan")])
def test_bad_liveness_settings_are_named(setting, value):
    # ("x" and [1] raised float()'s own ValueError / TypeError)
    with pytest.raises(ctrlcomm.InvalidArgumentError, match=f"{setting} must be > 0"):
        ctrlcomm.Group.create("127.0.0.1", free_port(), 0, 1, **{setting: value})


def test_port_in_use_names_the_address():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ctrlcomm.StoreError, match=f"127.0.0.1:{port}.*in use"):
            ctrlcomm.Group.create("127.0.0.1", port, 0, 2, timeout=2)


def test_formation_timeout_names_missing_ranks():
    t = time.monotonic()
    with pytest.raises(ctrlcomm.FormationTimeoutError, match=r"ranks \[1, 2\]") as e:
        ctrlcomm.Group.create("127.0.0.1", free_port(), 0, 3, timeout=1.0)
    assert e.value.missing == [1, 2]
    assert isinstance(e.value, TimeoutError)
    assert time.monotonic() - t < 3


def gives_up_first(rank, size, port, timeouts, start_after):
    """Rank r (of world 3; rank 2 never comes) starts after ``start_after[r]`` s with
    ``timeouts[r]``: whoever gives up first withdraws its key before the other's deadline.
    (A store of its own: rank 0's, hosted, would end as rank 0 gives up.)"""
    time.sleep(start_after[rank])
    try:
        ctrlcomm.Group.create("127.0.0.1", port, rank, 3, host_store=False,
                              timeout=timeouts[rank])
    except ctrlcomm.FormationTimeoutError as e:
        return str(e), e.missing, e.gave_up
    return "formed"


@pytest.mark.parametrize("first", [0, 1])
def test_a_formation_timeout_names_a_rank_that_joined_and_gave_up_as_such(first):
    """Rank 2 never comes. The rank that gives up first (its own deadline) had joined: the
    other names it as gone, not as missing (before: "ranks [1, 2] did not join", or on rank
    1 "ranks [0, 2]", from the keys left at the other's deadline)."""
    other = 1 - first
    timeouts = {first: 1.0, other: 3.0}
    start_after = {first: 0.0, other: 0.3}
    srv = ctrlcomm.StoreServer("127.0.0.1", 0)
    try:
        res = run_ranks(gives_up_first, 2, srv.port, timeouts, start_after, timeout=60)
    finally:
        srv.close()
    text, missing, gave_up = res[first]
    assert missing == [2] and gave_up == [], res
    assert "ranks [2] did not join" in text and "gave up" not in text, text
    text, missing, gave_up = res[other]
    assert missing == [2] and gave_up == [first], res
    assert f"ranks [2] did not join; ranks [{first}] joined and gave up" in text, text


def test_a_mark_of_a_rank_that_gave_up_in_an_earlier_try_does_not_count():
    """A formation try on a store of its own, rank 1 giving up first; then rank 0 alone:
    rank 1 did not join this try."""
    srv = ctrlcomm.StoreServer("127.0.0.1", 0)
    try:
        res = run_ranks(gives_up_first, 2, srv.port, {0: 2.0, 1: 0.5}, {0: 0, 1: 0},
                        timeout=60)
        assert res[0][1:] == ([2], [1]), res
        with pytest.raises(ctrlcomm.FormationTimeoutError) as e:
            ctrlcomm.Group.create("127.0.0.1", srv.port, 0, 3, host_store=False, timeout=0.5)
        assert e.value.missing == [1, 2] and e.value.gave_up == [], str(e.value)
    finally:
        srv.close()


def store_host_dies(rank, size, port):
    """Rank 0 (hosting the store) is killed 1.5 s after it starts; rank 1 waits for the
    address table (world 3: rank 2 never comes) with a timeout of 3 s."""
    if rank == 0:
        import os
        import signal

        threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
        ctrlcomm.Group.create("127.0.0.1", port, 0, 3, timeout=30)
        return None
    time.sleep(0.5)
    t = time.monotonic()
    try:
        ctrlcomm.Group.create("127.0.0.1", port, 1, 3, timeout=3.0)
    except ctrlcomm.FormationTimeoutError as e:
        return str(e), time.monotonic() - t, e.missing, e.gave_up
    return "formed"


def test_a_rank_whose_store_died_says_so_within_its_bound():
    """The README's bound: the deadline, half a second asking the store why, one more second
    for a store that answers nothing. (Before: 2 s over, from asking a dead store why after
    waiting out its reply slack; and the message blamed rank 0's table.)"""
    res = run_ranks(store_host_dies, 2, free_port(), may_die=(0,), timeout=60)
    text, took, missing, gave_up = res[1]
    # (it had read rank 0's key: rank 0 joined, then went, with its store)
    assert "which rank 0 hosts, answered nothing: rank 0, which had joined, is gone" in text, \
        text
    assert (missing, gave_up) == ([], [0])
    assert took < 3.0 + 1.5 + 0.4, took


def joins_then_dies(rank, size, port, flag):
    """World 3 on a store of the test's: rank 2 dies as soon as its key is in the store
    (it joined, and never reads the address table); rank 1 comes after that."""
    import os
    import pathlib
    import signal

    from ctrlcomm.rendezvous import _formation

    if rank == 2:
        def die(*args, **kwargs):  # (what a rank does once its key is set)
            pathlib.Path(flag).touch()
            os.kill(os.getpid(), signal.SIGKILL)

        _formation._join = die
    elif rank == 1:
        while not os.path.exists(flag):
            time.sleep(0.01)
        time.sleep(0.5)  # (rank 2 is gone by then)
    t = time.monotonic()
    try:
        g = ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="split",
                                  host_store=False, timeout=3.0 if rank == 0 else 20)
    except ctrlcomm.FormationTimeoutError as e:
        return "FormationTimeoutError", str(e), time.monotonic() - t
    g.close()
    return "formed"


def test_a_rank_that_joined_and_died_fails_the_formation_on_every_rank(store, tmp_path):
    """(Found in review: rank 1 had read the address table and returned a group while rank
    0's formation timed out, waiting for rank 2 to read it; rank 1's first call then failed
    at liveness, blaming rank 0, "rank 0 stopped answering heartbeats", alive, and not
    rank 2. Now the ranks settle the formation in one value of the store: both fail, at rank
    0's deadline, naming rank 2.)"""
    res = run_ranks(joins_then_dies, 3, store.port, str(tmp_path / "joined"), may_die=(2,),
                    timeout=60)
    for r in (0, 1):
        kind, text, took = res[r]
        assert kind == "FormationTimeoutError", res
        assert "ranks [2] did not read the address table in time" in text, text
        assert took < 3.0 + 1.5 + (0 if r == 0 else 1.0), res
    assert "(found by rank 0)" in res[1][1], res


def formed_and_counted(rank, size, port):
    ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="count", host_store=False,
                          timeout=20).close()
    return "formed"


def test_a_formation_leaves_no_key_of_its_own_in_the_store(store):
    """(Its keys are deleted by the ranks as they go: the last to read that the formation
    is settled deletes its counters, as the original's keys piled up in the TCPStore.)"""
    for size in (1, 2, 5):
        assert run_ranks(formed_and_counted, size, store.port, timeout=60) == ["formed"] * size
        c = ctrlcomm.StoreClient("127.0.0.1", store.port, timeout=5)
        try:
            t = time.monotonic()  # (the last rank's deletes may still be on their way)
            while (left := c.list_keys()) and time.monotonic() - t < 5:
                time.sleep(0.05)
            assert left == [], (size, left)
        finally:
            c.close()


def recreates_at_once(rank, size, port):
    """Create and close a group of one name, three times, nothing in between; rank 0 is slow
    (0.3 s, as a process descheduled on a loaded host) to clean the formation's keys."""
    if rank == 0:
        from ctrlcomm import StoreClient

        for method in ("delete_prefix", "multi_delete"):
            orig = getattr(StoreClient, method, None)
            if orig is not None:
                def slow(self, *a, _orig=orig, **k):
                    time.sleep(0.3)
                    return _orig(self, *a, **k)
                setattr(StoreClient, method, slow)
    out = []
    for _ in range(3):
        try:
            ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="same", timeout=5).close()
            out.append("formed")
        except ctrlcomm.CtrlcommError as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def test_a_group_created_again_at_once_after_close_forms():
    """(Before: a rank that had read the table returned while its key stayed until rank 0
    deleted the formation's keys; creating the group again at once, it found its own key:
    "rank 1 already joined", and the others timed out.)"""
    assert run_ranks(recreates_at_once, 3, free_port(), timeout=90) == [["formed"] * 3] * 3


def recreates_with_a_late_delete(rank, size, port):
    """Create and close a group of one name, three times, on a store of the test's; rank 1
    is slow (0.5 s, as a process descheduled) to delete its key once it read the table."""
    if rank == 1:
        from ctrlcomm import StoreClient

        real = StoreClient.delete

        def late(self, key, **kw):
            if "formation/rank/" in str(key):
                time.sleep(0.5)
            return real(self, key, **kw)

        StoreClient.delete = late
    out = []
    for _ in range(3):
        try:
            ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="again", timeout=5,
                                  host_store=False).close()
            out.append("formed")
        except ctrlcomm.CtrlcommError as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def test_a_group_created_again_at_once_forms_though_a_rank_deletes_its_key_late(store):
    """(Found in review: rank 1, the last to acknowledge the table, settled the formation
    and then deleted its key; rank 0 returned, closed and formed again, and took the key
    still there, rank 1's old address, into its next table: both failed.)"""
    assert run_ranks(recreates_with_a_late_delete, 2, store.port, timeout=90) == \
        [["formed"] * 3] * 2


def acknowledges_late(rank, size, port):
    """Rank 1 acknowledges the address table 3 s after it read it (a process descheduled);
    rank 0 gives up at 1.5 s."""
    if rank == 1:
        from ctrlcomm import StoreClient

        real = StoreClient.add

        def late(self, key, amount, **kw):
            if "formation/acks/" in str(key):
                time.sleep(3.0)
            return real(self, key, amount, **kw)

        StoreClient.add = late
    try:
        ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="late", host_store=False,
                              timeout=1.5 if rank == 0 else 10).close()
    except ctrlcomm.FormationTimeoutError as e:
        return str(e)
    return "formed"


def test_a_rank_that_acknowledges_after_rank_0_gave_up_does_not_form_alone(store):
    """(Found in review: rank 0, failed, deleted the formation's counters at once; rank 1,
    acknowledging later, counted anew as the last, settled the formation formed, and
    returned a group whose rank 0 had given up.)"""
    r0, r1 = run_ranks(acknowledges_late, 2, store.port, timeout=60)
    assert "not every rank read the address table in time" in r0, r0
    assert "(found by rank 0)" in r1, r1


def created_with_key(rank, size, port, keys, slow0=False, timeout1=2.0):
    if slow0 and rank == 0:
        # rank 0 slow to make its sockets once its store is up (a loaded host): rank 1's
        # handshake fails meanwhile, before rank 0 starts to wait for it (and where rank
        # 1's side saw the mechanism differ first, ZeroMQ does not try again)
        import ctrlcomm._forming as cg
        made = cg.make_endpoint

        def slowly(*a, **k):
            time.sleep(1.0)
            return made(*a, **k)
        cg.make_endpoint = slowly
    t = time.monotonic()
    try:
        ctrlcomm.Group.create("127.0.0.1", port, rank, size,
                              timeout=timeout1 if rank else 3.0 if slow0 else 2.0,
                              auth_key=keys[rank])
    except (ctrlcomm.FormationTimeoutError, ctrlcomm.StoreError) as e:
        return str(e), time.monotonic() - t
    return "formed", time.monotonic() - t


@pytest.mark.parametrize("keys", [(b"k0", b"k1"), (b"k0", None)], ids=["other", "none"])
def test_ranks_created_with_different_auth_keys_are_told_it_may_be_that(keys):
    """The README: a key that differs makes the store silent, and the error says so.
    (Before: rank 0 said rank 1 did not join; rank 1, that rank 0 did not come.)"""
    # (a rank without the key is told once it looks at the store's greeting, which it does
    # a second into an unanswered request: its deadline leaves it time, were rank 0 late)
    (r0, _), (r1, _) = run_ranks(created_with_key, 2, free_port(), keys,
                                 timeout1=2.0 if keys[1] else 30.0, timeout=60)
    assert "ranks [1] did not join (the store here dropped" in r0 and \
        "is a rank created with another auth_key, or none?" in r0, r0
    assert ("another auth_key than this rank's" if keys[1] else
            "runs with an auth_key, or encryption, and this client has neither") in r1, r1


def test_a_rank_without_the_key_is_told_at_once_and_counted_where_it_came_early():
    """(CI, under load: rank 1's handshake failed while rank 0 still made its sockets, and
    where rank 1's ZeroMQ saw the mechanism differ first, it did not try again: rank 0,
    counting failures from its rendezvous on, said only that rank 1 did not join, and rank
    1 waited out its whole deadline)"""
    (r0, _), (r1, took1) = run_ranks(created_with_key, 2, free_port(), (b"k0", None),
                                     slow0=True, timeout1=30.0, timeout=60)
    assert "ranks [1] did not join (the store here dropped" in r0 and \
        "requests or connections it could not authenticate" in r0 and \
        "is a rank created with another auth_key, or none?" in r0, r0
    assert "runs with an auth_key, or encryption, and this client has neither" in r1, r1
    assert took1 < 15, took1


def created_with_key_of_a_store_without(rank, size, port):
    t = time.monotonic()
    try:
        ctrlcomm.Group.create("127.0.0.1", port, rank, size, timeout=30 if rank else 3,
                              auth_key=b"k1" if rank else None)
    except ctrlcomm.CtrlcommError as e:
        return type(e).__name__, str(e), time.monotonic() - t
    return "formed"


def test_a_rank_with_a_key_is_told_at_once_that_rank_0s_store_has_none():
    """(Found in review: once a keyed store ran CurveZMQ's handshake, a keyed rank's
    handshake with a store without a key failed unanswered, and it waited out its whole
    deadline to be told that rank 0 did not come; before, the store's unsigned reply said
    it at once.)"""
    r0, r1 = run_ranks(created_with_key_of_a_store_without, 2, free_port(), timeout=60)
    assert r1[0] == "StoreError" and "runs without this group's auth_key" in r1[1], r1
    assert r1[2] < 15, r1
    assert r0[0] == "FormationTimeoutError", r0


def test_a_timeout_given_as_a_str_is_refused():
    """(before: barrier(timeout="5") and a store get(timeout="5") took it as 5 s)"""
    with ctrlcomm.Group.create("127.0.0.1", free_port(), 0, 1, timeout=5) as g:
        with pytest.raises(ctrlcomm.InvalidArgumentError, match="timeout"):
            g.barrier(timeout="5")
        with pytest.raises(ctrlcomm.InvalidArgumentError, match="timeout"):
            g.store.get("k", timeout="5")
        g.barrier(timeout=5)
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="timeout"):
        ctrlcomm.Group.create("127.0.0.1", free_port(), 0, 1, timeout="5")


def created_otherwise(rank, size, port, settings, timeout):
    """Rank r is created with ``settings[r]`` (world size, codec, transport)."""
    ws, codec, transport = settings[rank]
    if transport == "zmq":
        import zmq  # noqa: F401  (imported before the clock starts: under load an import
        # took a second of the slack below, and it is not the formation's deadline)
    if codec == "msgpack":
        import msgpack  # noqa: F401
    t = time.monotonic()
    try:
        ctrlcomm.Group.create("127.0.0.1", port, rank, ws, codec=codec, transport=transport,
                              timeout=timeout)
    except ctrlcomm.FormationError as e:
        return type(e).__name__, str(e), time.monotonic() - t
    return "formed", "", time.monotonic() - t


def of_another_wire_version(rank, size, port, older):
    """Rank ``older`` runs as a ctrlcomm whose wire format has an earlier version."""
    from ctrlcomm import _wire

    if rank == older:
        _wire.VERSION -= 1  # (what its address says at formation: nothing is sent before)
    return created_otherwise(rank, size, port, [(2, "pickle", "tcp")] * 2, 4.0)


@pytest.mark.parametrize("older", [0, 1])
def test_ranks_of_different_wire_versions_are_told_so_at_formation(older):
    # (a rank of another version drops every message of this one as malformed: the calls
    # waited to their deadlines)
    from ctrlcomm import _wire

    v = _wire.VERSION
    for kind, text, _took in run_ranks(of_another_wire_version, 2, free_port(), older,
                                       timeout=60):
        assert kind in ("FormationError", "FormationTimeoutError"), (kind, text)
        assert f"rank 0 with world size 2, codec pickle, transport tcp, wire version " \
            f"{v - (older == 0)}" in text and f"rank 1 with wire version {v - (older == 1)}" \
            in text, text


def test_a_rank_of_a_release_without_wire_versions_differs_too():
    from ctrlcomm.rendezvous._formation import _differ

    new, old = "tcp://a 1 ws:2 codec:1 tr:tcp wire:2", "tcp://b 2 ws:2 codec:1 tr:tcp"
    assert "rank 1 with wire version ?" in _differ("g", new, {1: old})
    assert "rank 0 with world size 2, codec 1, transport tcp, wire version ?; rank 1 with " \
        "wire version 2" in _differ("g", old, {1: new})
    assert _differ("g", old, {1: old}) == "" and _differ("g", new, {1: new}) == ""


@pytest.mark.parametrize(("settings", "named"), [
    ([(2, "pickle", "tcp"), (3, "pickle", "tcp")], "rank 1 with world size 3"),
    ([(3, "pickle", "tcp"), (2, "pickle", "tcp")], "rank 1 with world size 2"),
    ([(2, "pickle", "tcp"), (2, "msgpack", "tcp")], "rank 1 with codec msgpack"),
    ([(2, "pickle", "tcp"), (2, "pickle", "zmq")], "rank 1 with transport zmq"),
], ids=["world_size_larger", "world_size_smaller", "codec", "transport"])
def test_ranks_created_with_different_settings_are_told_what_differs(settings, named):
    """Each rank says what differs (it waited, or failed later, without saying why: a
    codec mismatch formed a group whose pickling rank never learnt of the other's failure),
    within its formation deadline."""
    timeout = 4.0
    for kind, text, took in run_ranks(created_otherwise, 2, free_port(), settings, timeout,
                                      timeout=60):
        assert kind in ("FormationError", "FormationTimeoutError"), (kind, text)
        assert named in text and "rank 0 with world size" in text, text
        assert took < timeout + 2.0, took  # (its deadline: it overran by 3 s)


@pytest.mark.parametrize(("settings", "named"), [
    ([(3, "pickle", "tcp"), (2, "pickle", "tcp")], "rank 1 with world size 2"),
    ([(4, "pickle", "tcp"), (4, "pickle", "tcp"), (3, "pickle", "tcp")],
     "rank 2 with world size 3"),
    ([(3, "pickle", "tcp"), (3, "msgpack", "tcp")], "rank 1 with codec msgpack"),
], ids=["rank0_larger", "rank0_and_rank1_larger", "codec_rank_missing"])
def test_rank_0_waiting_for_ranks_that_never_come_fails_once_a_joined_rank_differs(
        settings, named):
    """Rank 0 created with a larger world size than another rank (a multi-host bench with a
    mistyped --world-size) waited out its whole formation deadline for a rank that never
    comes, though the rank created otherwise had failed at once. Now it compares the settings
    of the ranks in as it waits, fails within seconds, and tells the ranks that wait with it
    (rank 1 of the second case, created as rank 0 was)."""
    timeout = 40.0
    res = run_ranks(created_otherwise, len(settings), free_port(), settings, timeout,
                    timeout=90)
    for kind, text, took in res:
        assert kind == "FormationError", res
        assert named in text and "rank 0 with world size" in text, text
        assert took < 15.0, res  # (all took 40 s for rank 0's deadline before)


def rank0_joins_late(rank, size, port, delay, timeout):
    if rank == 0:
        time.sleep(delay)
    with ctrlcomm.Group.create("127.0.0.1", port, rank, size, timeout=timeout) as g:
        return g.all_reduce(1)


def test_a_rank_0_that_joins_late_but_within_the_timeout_forms_the_group():
    """Formation waits out its whole timeout (it gave up a fifth or more early)."""
    assert run_ranks(rank0_joins_late, 2, free_port(), 4.0, 5.0, timeout=60) == [2, 2]


def test_world_of_one_in_process():
    with ctrlcomm.Group.create("127.0.0.1", free_port(), 0, 1) as g:
        assert g.all_reduce((1, 2)) == (1, 2)
        assert g.all_gather("x") == ["x"]
        assert g.gather(1) == [1] and g.reduce(5) == 5 and g.scatter(["a"]) == "a"
        assert asyncio.run(g.aio.broadcast(7)) == 7
        g.barrier()


def duplicate_rank(rank, size, port):
    try:
        ctrlcomm.Group.create("127.0.0.1", port, min(rank, 1), 3, timeout=3)
    except ctrlcomm.FormationError as e:
        return type(e).__name__, str(e), os.getpid()
    return "formed", "", os.getpid()


def test_two_processes_with_one_rank():
    """The one that comes second is told, with the process that holds the rank (its pid,
    this host's) and where it joined from."""
    res = run_ranks(duplicate_rank, 3, free_port())
    kinds = [k for k, _, _ in res]
    assert "FormationError" in kinds, res
    i = kinds.index("FormationError")
    msg = res[i][1]
    assert "rank 1 already joined" in msg
    other = res[3 - i][2]  # (processes 1 and 2 are both rank 1)
    assert f"by process {other} of this host" in msg, (msg, other)
    assert re.search(r"from tcp://127\.0\.0\.1:\d+ ", msg), msg
    assert "ws:" not in msg  # (the rest of its address line: not for a reader)


def duplicate_rank_after_formation(i, _, port):
    """Processes 0 and 1 form a group of two; process 2, also rank 1, comes after."""
    if i < 2:
        with ctrlcomm.Group.create("127.0.0.1", port, i, 2, timeout=10):
            time.sleep(5.0)  # (rank 0's process serves the store meanwhile)
        return "formed", ""
    time.sleep(2.0)
    try:
        ctrlcomm.Group.create("127.0.0.1", port, 1, 2, timeout=2.0)
    except ctrlcomm.FormationError as e:
        return type(e).__name__, str(e)
    return "formed", ""


def test_a_process_with_a_rank_of_a_group_formed_already_is_told_it_may_be_one_too_many():
    res = run_ranks(duplicate_rank_after_formation, 3, free_port(), timeout=60)
    assert res[:2] == [("formed", "")] * 2, res
    kind, text = res[2]
    # (told at once, from the table rank 0 keeps in the store while the group lives)
    assert kind == "FormationError" and "formed without this process" in text, res
    assert re.search(r"rank 1 joined from tcp://127\.0\.0\.1:\d+ by process \d+ of this "
                     "host", text), text


def from_env(rank, size, port, torchrun):
    import os

    if torchrun:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(size))
    else:
        os.environ.update(CTRLCOMM_HOST="127.0.0.1", CTRLCOMM_PORT=str(port),
                          CTRLCOMM_RANK=str(rank), CTRLCOMM_WORLD_SIZE=str(size),
                          CTRLCOMM_NAME="envgroup")
    with ctrlcomm.Group.from_env() as g:
        return g.name, g.rank, g.world_size, g.all_gather(g.rank)


@pytest.mark.parametrize("torchrun", [False, True])
def test_from_env(torchrun):
    res = run_ranks(from_env, 3, free_port(), torchrun)
    for r, (name, rank, ws, ag) in enumerate(res):
        assert (rank, ws, ag) == (r, 3, [0, 1, 2])
        assert name == ("default" if torchrun else "envgroup")


TORCHRUN_CHILD = """
import json, os
import torch.distributed as dist
import ctrlcomm
from ctrlcomm import _wire

dist.init_process_group("gloo")  # (its store: torchrun's agent's, on MASTER_PORT too)
out = []
for _ in range(2):  # (two groups of one name, one after the other)
    with ctrlcomm.Group.from_env(timeout=30) as g:
        out.append(g.all_gather(g.rank))
with ctrlcomm.Group.from_env(name="other", timeout=30) as g:
    out.append(g.all_reduce(g.rank + 1))
dist.barrier()
dist.destroy_process_group()
# (one write: the two ranks share torchrun's stdout, and print's pieces interleaved)
os.write(1, f"RESULT {os.environ['RANK']} {json.dumps(out)}\\n".encode())
"""


@pytest.mark.slow
def test_from_env_under_torchrun(tmp_path):
    """Under torchrun its agent's store holds MASTER_PORT (before: rank 0 could not bind
    its store there, "address already in use", and rank 1 timed out asking it)."""
    pytest.importorskip("torch")
    import subprocess
    import sys

    script = tmp_path / "child.py"
    script.write_text(TORCHRUN_CHILD)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", str(script)],
                       capture_output=True, text=True, timeout=180)
    got = sorted(line.split(" ", 2)[1:] for line in p.stdout.splitlines()
                 if line.startswith("RESULT"))
    assert p.returncode == 0 and got == [["0", "[[0, 1], [0, 1], 3]"],
                                         ["1", "[[0, 1], [0, 1], 3]"]], p.stdout + p.stderr


def test_from_env_missing_variables(monkeypatch):
    for v in ("CTRLCOMM_HOST", "CTRLCOMM_PORT", "CTRLCOMM_RANK", "CTRLCOMM_WORLD_SIZE",
              "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="CTRLCOMM_PORT"):
        ctrlcomm.Group.from_env()
    # what the environment gives is not also a keyword (before: a bare TypeError, "got
    # multiple values for argument 'rank'")
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="rank, world_size come from the "
                                                            "environment.*Group.create"):
        ctrlcomm.Group.from_env(rank=0, world_size=1)


def test_bad_timeouts_are_invalid_arguments_naming_them(monkeypatch):
    for bad in ("x", [1], None, 0, -1, float("nan")):
        with pytest.raises(ctrlcomm.InvalidArgumentError, match="timeout"):
            ctrlcomm.Group.create("127.0.0.1", 29999, 0, 1, timeout=bad)
    monkeypatch.setenv("CTRLCOMM_HOST", "127.0.0.1")
    monkeypatch.setenv("CTRLCOMM_PORT", "29999")
    monkeypatch.setenv("CTRLCOMM_RANK", "0")
    monkeypatch.setenv("CTRLCOMM_WORLD_SIZE", "1")
    monkeypatch.setenv("CTRLCOMM_TIMEOUT", "soon")
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="CTRLCOMM_TIMEOUT.*'soon'"):
        ctrlcomm.Group.from_env()


def timedelta_timeouts(g):
    import datetime

    td = datetime.timedelta(seconds=20)
    out = [g.all_reduce(1, timeout=td), g.all_gather(g.rank, timeout=td)]
    if g.rank == 0:
        g.send("x", dst=1, timeout=td)
    else:
        out.append(g.recv(src=0, timeout=td))
    g.barrier(timeout=td)
    try:
        g.barrier(timeout=datetime.timedelta(0))
    except ctrlcomm.InvalidArgumentError as e:
        out.append(str(e))
    return out, g._core.timeout


def test_timeouts_may_be_timedeltas_as_torch_distributed_takes_them():
    import datetime

    from ctrlcomm.testing import free_port

    # the store client's and vLLM's store_timeout too
    with ctrlcomm.StoreServer("127.0.0.1", 0) as srv:
        st = ctrlcomm.StoreClient("127.0.0.1", srv.port, timeout=datetime.timedelta(seconds=9))
        assert st.timeout == 9.0
        st.close()
    pg = ctrlcomm.StatelessProcessGroup.create("127.0.0.1", free_port(), 0, 1,
                                               store_timeout=datetime.timedelta(seconds=30))
    assert pg.group._core.timeout == 30.0
    pg.close()

    res = run_group(timedelta_timeouts, 2,
                    group_kwargs={"timeout": datetime.timedelta(minutes=2),
                                  "liveness_timeout": datetime.timedelta(seconds=10)})
    for out, default in res:
        assert out[:2] == [2, [0, 1]] and default == 120.0, out
        assert out[-1].startswith("barrier") and "timeout must be > 0" in out[-1], out
    assert res[1][0][2] == "x"


def calls_with_bad_timeouts(g):
    errors = []
    for call in (lambda: g.all_reduce(1, timeout="x"), lambda: g.barrier(timeout=[1]),
                 lambda: g.recv(src=1 - g.rank, timeout="x"),
                 lambda: g.send(1, dst=1 - g.rank, timeout=object())):
        try:
            call()
        except ctrlcomm.InvalidArgumentError as e:
            errors.append(str(e))
    return errors, g.all_reduce(1)


def test_calls_with_bad_timeouts_raise_invalid_arguments_and_the_group_goes_on():
    for errors, total in run_group(calls_with_bad_timeouts, 2):
        assert len(errors) == 4 and all("timeout" in e for e in errors), errors
        assert total == 2


def forms_without_a_deadline(rank, size, port, transport):
    g = ctrlcomm.Group.create("127.0.0.1", port, rank, size, timeout=float("inf"),
                              host_store=False, transport=transport, liveness_timeout=None,
                              name=f"nodeadline-{transport}")
    out = [g.all_gather(rank)]
    if rank == 0:
        g.send("hi", 1, timeout=float("inf"))
    else:
        out.append(g.recv(0, timeout=float("inf")))
    g.barrier(timeout=float("inf"))
    g.close()
    return out


@pytest.mark.parametrize("transport", ["tcp", "zmq"])
def test_a_group_without_a_deadline_forms_and_works(store, transport):
    res = run_ranks(forms_without_a_deadline, 2, store.port, transport, timeout=60)
    assert res == [[[0, 1]], [[0, 1], "hi"]]


def test_rank_failure_is_reported_by_runner():
    with pytest.raises(RankFailedError):
        run_group(_raises, 2)


def _raises(g):
    raise RuntimeError("boom")


def waits_for_a_rank_that_breaks(g):
    """Rank 1's broadcast times out (rank 0 is in a recv, not in it): its group is broken;
    then it closes. Rank 0, waiting for it, learns why."""
    if g.rank == 0:
        try:
            g.recv(1, timeout=30)
        except ctrlcomm.CtrlcommError as e:
            return type(e).__name__, str(e)
        return "returned", ""
    try:
        g.broadcast(None, src=0, timeout=0.5)
    except ctrlcomm.CollectiveTimeoutError as e:
        return type(e).__name__, str(e)
    return "returned", ""


def test_a_peer_that_closes_a_broken_group_says_why():
    res = run_group(waits_for_a_rank_that_breaks, 2)
    assert res[1][0] == "CollectiveTimeoutError", res
    kind, text = res[0]
    # told as rank 1's broadcast timed out, waiting for rank 0 (which was not in it); else,
    # had that word not come, at rank 1's close, with why its group was broken
    assert kind == "PeerLostError" and ("rank 1 aborted the group: " in text or
                                        "rank 1 closed the group (broken there: " in text), res
    assert "broadcast #0" in text and "timed out after 0.5 s" in text, text


def scatter_and_all_to_all_of_arrays(g):
    import numpy as np
    import torch

    r, n = g.rank, g.world_size
    got = [
        g.scatter(np.arange(n) * 10 if r == 0 else None, src=0),  # its elements
        g.scatter(np.arange(2 * n).reshape(n, 2) if r == 0 else None, src=0).tolist(),  # rows
        g.all_to_all(np.full(n, r)),
        g.scatter(torch.arange(n) + 1 if r == 0 else None, src=0).item(),
        g.all_to_all(range(r * n, r * n + n)),
        g.all_to_all(__import__("collections").deque([r] * n)),
        # (a row of a tensor is a view: it pickled with the whole storage, n times the row)
        g.scatter(torch.arange(n * 1000.0).reshape(n, 1000) if r == 0 else None,
                  src=0).untyped_storage().nbytes(),
    ]
    errors = []
    for bad in ({i: i for i in range(n)}, set(range(n)), "x" * n, b"x" * n,
                np.int64(3), np.array(5), iter(range(n))):
        try:
            g.scatter(bad if r == 0 else None, src=0)
        except ctrlcomm.InvalidArgumentError as e:
            errors.append(str(e))
    return [int(got[0]), got[1], [int(x) for x in got[2]], *got[3:]], errors, g.all_reduce(1)


def test_scatter_and_all_to_all_take_arrays_and_other_sized_iterables():
    # (as mpi4py's do: a numpy array of one object per rank, its elements or rows; they took
    # only a Sequence and refused an array as "not a sequence")
    pytest.importorskip("numpy")
    pytest.importorskip("torch")
    n = 3
    for r, (got, errors, after) in enumerate(run_group(scatter_and_all_to_all_of_arrays, n)):
        assert got == [10 * r, [2 * r, 2 * r + 1], list(range(n)), r + 1,
                       [i * n + r for i in range(n)], list(range(n)), 4000], (r, got)
        assert len(errors) == 7 and after == n, (r, errors)
        for e, name in zip(errors, ["dict", "set", "str", "bytes", "int64", "ndarray",
                                    "range_iterator"], strict=True):
            assert "scatter on rank 0" in e and name in e, e


def retried_after_a_timeout(rank, size, port, store_port, api):
    """The rank that comes first gives up (the other is not there yet) and tries again, as
    a launcher would; the other comes while the first waits in its second try."""
    import time

    first = "timeout" if (rank == 0) == (store_port == 0) else None  # (who gives up first)
    host_port = port if store_port == 0 else store_port

    def create(timeout):
        if api == "vllm":
            return ctrlcomm.StatelessProcessGroup.create("127.0.0.1", host_port, rank, size,
                                                         store_timeout=timeout)
        return ctrlcomm.Group.create("127.0.0.1", host_port, rank, size, name="retry",
                                     timeout=timeout, host_store=store_port == 0 and rank == 0)

    if first:
        try:
            create(1)
            return "formed without the other rank"
        except TimeoutError:  # (a FormationTimeoutError is one: vLLM's callers catch it)
            pass
    else:
        time.sleep(3)
    g = create(30)
    with g:
        return g.all_gather_obj(rank) if api == "vllm" else g.all_gather(rank)


@pytest.mark.parametrize(("store", "api"), [
    ("rank 0's, rank 0 retries", "group"), ("rank 0's, rank 0 retries", "vllm"),
    ("external, rank 1 retries", "group")])  # (StatelessProcessGroup: rank 0 hosts the store)
def test_a_rank_whose_formation_timed_out_can_try_again(store, api):
    # (its key stayed in the store: its second try failed at once, "rank 0 already joined",
    # or a rank 0 coming later paired the other with the address of the try that gave up)
    if store.startswith("external"):
        with ctrlcomm.StoreServer("127.0.0.1", 0) as srv:
            res = run_ranks(retried_after_a_timeout, 2, 0, srv.port, api, timeout=90)
    else:
        res = run_ranks(retried_after_a_timeout, 2, free_port(), 0, api, timeout=90)
    assert res == [[0, 1], [0, 1]]


def recv_from_a_rank_that_aborts(g, mode):
    if g.rank == 0:
        time.sleep(0.5)  # (rank 1 waits in its recv by then, most likely; either way the same)
        g.abort("watchdog: step hung")
        return None
    out = []
    for call in (lambda: g.recv(0, timeout=30) if mode == "blocking" else
                 asyncio.run(g.aio.recv(0, timeout=30)),
                 lambda: g.recv(0, timeout=30),  # (entered on the group known broken)
                 lambda: g.barrier(timeout=30)):
        try:
            call()
            out.append("returned")
        except ctrlcomm.GroupBrokenError as e:
            out.append((type(e).__name__, getattr(e, "ranks", None),
                        "rank 0 aborted the group: watchdog: step hung" in str(e)))
    return out


@pytest.mark.parametrize("mode", ["blocking", "awaited"])
def test_a_recv_from_a_rank_that_aborts_raises_peer_lost(mode):
    # (README: peers of a rank that aborts get PeerLostError naming it, in a recv from it as in
    # a collective; the recv raised a plain GroupBrokenError, which `except PeerLostError`
    # misses, and so did any call after it)
    got = run_group(recv_from_a_rank_that_aborts, 2, mode)[1]
    assert got == [("PeerLostError", [0], True)] * 3, got


def test_a_stale_address_table_times_out_as_a_timeout():
    # A table left in the store (rank 0 published it for an earlier try of rank 1, whose
    # address it holds) was reported as a plain FormationError at the deadline, which a
    # launcher retrying on TimeoutError took for final; and the rank's key is taken back.
    with ctrlcomm.StoreServer("127.0.0.1", 0) as srv:
        c = ctrlcomm.StoreClient("127.0.0.1", srv.port, timeout=5, prefix="ctrlcomm/stale/")
        try:
            f = "ctrlcomm:formation/"
            # (a rank 0 that joined, published and was gone: its client, joined)
            c.set_if_absent(f + "rank/0",
                            f"tcp://127.0.0.1:9 9 ws:2 codec:pickle tr:shm wire:{_wire.VERSION}")
            c.set(f + "table", "00ff\ntcp://127.0.0.1:9 9\ntcp://127.0.0.1:10 10")
            with pytest.raises(ctrlcomm.FormationTimeoutError, match="does not hold this rank's"):
                ctrlcomm.Group.create("127.0.0.1", srv.port, 1, 2, name="stale", timeout=1.5,
                                      host_store=False)
            assert not c.check([f + "rank/1"])
        finally:
            c.close()


def broken_then_closed(g):
    before = g.broken, g.closed
    if g.rank == 0:
        g.abort("on purpose")
    try:
        g.barrier(timeout=30)
    except ctrlcomm.CtrlcommError:
        pass
    broken = g.broken, g.closed
    g.close()
    return before, broken, (g.broken, g.closed)


def plain_close(g):
    g.barrier()
    g.close()
    return g.broken, g.closed


def test_a_broken_group_says_so_once_closed_too():
    # (before: `broken` was the state's name, "closed" once closed: False again)
    for r, (before, broken, after) in enumerate(run_group(broken_then_closed, 2)):
        assert before == (False, False) and broken == (True, False) \
            and after == (True, True), (r, before, broken, after)
    assert run_group(plain_close, 2) == [(False, True)] * 2


def all_reduce_while_a_rank_aborts(g, mode):
    if g.rank == 2:
        time.sleep(0.5)  # (ranks 0 and 1 wait in the all_reduce by then)
        g.abort("watchdog: step hung")
        return None
    try:
        if mode == "blocking":
            g.all_reduce(1, timeout=30)
        else:
            asyncio.run(g.aio.all_reduce(1, timeout=30))
    except ctrlcomm.CtrlcommError as e:
        return type(e).__name__, getattr(e, "ranks", None), str(e)
    return "returned"


@pytest.mark.parametrize("mode", ["blocking", "awaited"])
def test_a_collective_a_peer_aborts_names_itself(mode):
    # (found in review: the error of a call in progress as a peer's word of its abort came
    # said only "group 'g': rank 2 aborted the group: ...", without the op, where every other
    # way of losing a peer says which call could not complete)
    got = run_group(all_reduce_while_a_rank_aborts, 3, mode)
    for r in (0, 1):
        kind, ranks, text = got[r]
        assert kind == "PeerLostError" and ranks == [2], got
        assert re.search(f"all_reduce #0 on group '.*' cannot complete on rank {r}: ", text) \
            and "rank 2 aborted the group: watchdog: step hung" in text, text
