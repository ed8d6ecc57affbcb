"""How a group's core fails a call when it learns that the ranks are out of step, whatever
the order and grouping in which its reads deliver the messages that show it.

The core runs against a scripted in-memory endpoint (each drain delivers the next batch):
this tests the mailbox's decisions, not communication (tests/group does that with real
ranks over real sockets)."""

import pickle

import pytest

import ctrlcomm
from ctrlcomm import _wire as w
from ctrlcomm._core import Core
from ctrlcomm._group import Group
from ctrlcomm.testing._standin import StandInEndpoint

GID = 7


class ScriptedEndpoint(StandInEndpoint):
    def __init__(self, batches, unflushed=False):
        super().__init__()
        self.batches = list(batches)
        self.unflushed = {"queued"} if unflushed else set()
        self.sent = []

    def send_framed(self, dsts, data):
        self.sent.append(list(dsts))

    def send_many(self, dsts, frames):
        self.sent.append(list(dsts))

    def drain(self, sink):
        got = self.batches.pop(0) if self.batches else []
        for m in got:
            sink(m)
        return len(got)

    def backlog(self, dst):
        self.unflushed = set()
        return 0



def patch_clock(monkeypatch, clock):
    """The core's clock, in each of its modules that reads it."""
    import importlib
    import pkgutil

    import ctrlcomm._core as core

    names = [f"ctrlcomm._core.{m.name}" for m in pkgutil.iter_modules(core.__path__)]
    for name in [*names, "ctrlcomm._aio"]:  # (and the asyncio driver's fairness)
        mod = importlib.import_module(name)
        if hasattr(mod, "_monotonic"):
            monkeypatch.setattr(mod, "_monotonic", clock)

def group(rank, size, endpoint):
    core = Core(name="g", rank=rank, size=size, group_id=GID, endpoint=endpoint,
                codec=w.PICKLE, key=b"k" * 32, timeout=5.0)
    g = Group.__new__(Group)
    g._core = core
    return g


def bcast_from(src, seq, obj):
    return w.Message(w.COLL, src, GID, seq, 0, w.OP_CODE["broadcast"], src, w.PICKLE,
                     pickle.dumps(obj, protocol=5))


def all_reduce_from(src, seq):
    return w.Message(w.COLL, src, GID, seq, 0, w.OP_CODE["all_reduce"] | (1 << 4), w.NO_ROOT,
                     w.PICKLE, pickle.dumps(1, protocol=5))


def test_a_told_mismatch_read_with_the_calls_last_message_fails_the_call():
    """Rank 1 waits for rank 2's broadcast; one read brings rank 0's report of a mismatch
    and then rank 2's message: the call raises, it does not return rank 2's object."""
    told = w.Message(w.ABORT, 0, GID, 0, 0, payload=w.AbortReason(w.ABORT_MISMATCH, "ranks differ").encode())
    g = group(1, 3, ScriptedEndpoint([[told, bcast_from(2, 0, "hello")]]))
    with pytest.raises(ctrlcomm.MismatchError, match=r"ranks differ \(reported by rank 0\)"):
        g.broadcast(None, src=2)
    assert g.broken


def test_a_late_mismatch_read_after_the_group_broke_still_fails_the_call():
    """Rank 1 broadcast as root in #0 and returned (its look at what had come in, before it
    sent, found nothing); in #1 one read brings a mismatch rank 0 reported, rank 0's message
    of #0 naming another root, and rank 2's of #1."""
    told = w.Message(w.ABORT, 0, GID, 0, 0, payload=w.AbortReason(w.ABORT_MISMATCH, "elsewhere").encode())
    ep = ScriptedEndpoint([[], [told, bcast_from(0, 0, "x"), bcast_from(2, 1, "y")]])
    g = group(1, 3, ep)
    assert g.broadcast("mine", src=1) == "mine"  # #0: a root sends and returns
    with pytest.raises(ctrlcomm.MismatchError):
        g.broadcast(None, src=2)  # #1


def test_a_mismatch_read_while_a_root_sends_fails_its_call():
    """A broadcast root waits for nothing, but its send found queued data and read while
    it flushed: a message of this call from a rank in an all_reduce. The root raises."""
    ep = ScriptedEndpoint([[all_reduce_from(0, 0)]], unflushed=True)
    g = group(1, 3, ep)
    with pytest.raises(ctrlcomm.MismatchError, match="all_reduce"):
        g.broadcast("obj", src=1)


def test_a_mismatch_found_at_a_deadline_is_told_as_one_to_a_rank_in_that_call():
    desc = "collective #0 mismatch on group 'g': rank 0 called all_reduce(op='sum'); ..."
    told = w.Message(w.ABORT, 0, GID, 0, w.ABORT_BY_PROBE,
                     payload=w.AbortReason(w.ABORT_MISMATCH, desc).encode())
    g = group(1, 3, ScriptedEndpoint([[told]]))
    with pytest.raises(ctrlcomm.MismatchTimeoutError) as e:
        g.broadcast(None, src=0)
    assert e.value.mismatch == desc and e.value.seq == 0 and e.value.op == "broadcast"
    assert e.value.waiting_for == [0] and "not asked" in e.value.peer_states[0]
    assert "(reported by rank 0, which asked the ranks it waited for)" in str(e.value)


class Clock:
    """The core's clock, moved on by the endpoint's waits (a wait sleeps its whole timeout
    unless answers are due)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class ProbedEndpoint(ScriptedEndpoint):
    """Records when a status request goes to whom; ``answers`` maps the number of the
    request (0, 1...) to the messages that come back with the next read."""

    def __init__(self, clock, answers=None):
        super().__init__([])
        self.clock = clock
        self.answers = dict(answers or {})
        self.asked = []

    def send(self, dst, frames):
        m = w.decode(frames, b"k" * 32, dst)
        if m.kind == w.STATUS_REQ:
            self.answers_due = getattr(self, "answers_due", []) + \
                self.answers.pop(len(self.asked), [])
            self.asked.append((round(self.clock.now - 1000.0, 3), dst))

    def drain(self, sink):
        got, self.answers_due = getattr(self, "answers_due", []), []
        for m in got:
            sink(m)
        return len(got)

    def wait(self, timeout):
        if not getattr(self, "answers_due", None):  # else the answers wake it at once
            self.clock.now += max(timeout, 0.0)


def status_from(src, seq, opname, root, flag):
    op = w.OP_CODE[opname] | (1 << 4 if opname == "all_reduce" else 0)  # (op="sum")
    return w.Message(w.STATUS_REP, src, GID, seq, flag, op, root, payload=b"(state)")


def test_a_waiting_collective_asks_early_then_less_and_less_often(monkeypatch):
    """Nothing arrives: the call asks the rank it waits for 1, 3, 7 and 15 s into its call,
    then shortly before its 20 s deadline, and times out then (a plain timeout: nobody
    answered)."""
    clock = Clock()
    patch_clock(monkeypatch, clock)
    ep = ProbedEndpoint(clock)
    g = group(1, 2, ep)
    with pytest.raises(ctrlcomm.CollectiveTimeoutError) as e:
        g.broadcast(None, src=0, timeout=20.0)
    assert not isinstance(e.value, ctrlcomm.MismatchError)
    assert ep.asked == [(1.0, 0), (3.0, 0), (7.0, 0), (15.0, 0), (19.75, 0)]
    assert clock.now - 1000.0 == pytest.approx(20.0)


@pytest.mark.parametrize("flag", [w.STATUS_IN_CALL, w.STATUS_RETURNED], ids=["in", "returned"])
def test_an_answer_of_another_call_at_this_seq_raises_the_mismatch_at_once(monkeypatch, flag):
    """Asked 1 s into the call, rank 0 says it is in (or returned from) gather(root=0) #0
    while this rank waits in broadcast(root=0) #0: a mismatch and a timeout, raised then,
    19 s before the deadline, and told to the others."""
    clock = Clock()
    patch_clock(monkeypatch, clock)
    ep = ProbedEndpoint(clock, {0: [status_from(0, 0, "gather", 0, flag)]})
    told = []
    g = group(1, 3, ep)
    monkeypatch.setattr(g._core, "_tell_peers", lambda *a, **k: told.append((a, k)))
    with pytest.raises(ctrlcomm.MismatchTimeoutError) as e:
        g.broadcast(None, src=0, timeout=20.0)
    assert clock.now - 1000.0 == pytest.approx(1.0)
    assert e.value.seq == 0 and e.value.waiting_for == [0] and e.value.op == "broadcast"
    assert e.value.mismatch.endswith("rank 1 called broadcast(root=0); "
                                     "rank 0 called gather(root=0)"), e.value.mismatch
    assert "cannot complete" in str(e.value) and e.value.mismatch in str(e.value)
    assert g.broken
    assert [(kind, seq, rnd) for (kind, _, seq, rnd), _ in told] == [(w.ABORT, 0, w.ABORT_BY_PROBE)]
    # and which call this rank is in, for a rank told before it asked (it says so)
    assert told[0][1] == {"op": w.OP_CODE["broadcast"], "root": 0}, told


@pytest.mark.parametrize("answer", [
    ("broadcast", 0, 0),  # in the same call (waiting for another rank)
    ("gather", 0, -1),  # in another call at an earlier seq: merely late
    ("gather", 0, 1),  # at a later seq (ahead: what it says of this seq is not known)
], ids=["same_call", "earlier_seq", "later_seq"])
def test_an_answer_that_shows_no_mismatch_lets_the_call_wait_on(monkeypatch, answer):
    """A peer in this very call, or in another call of an earlier seq (late), is no
    mismatch: the call goes on waiting and completes when the message comes."""
    opname, root, dseq = answer
    clock = Clock()
    patch_clock(monkeypatch, clock)
    ep = ProbedEndpoint(clock, {
        1: [status_from(0, 1 + dseq, opname, root, w.STATUS_IN_CALL)],
        2: [bcast_from(0, 1, "late but here")]})
    g = group(1, 2, ep)
    g._core.seq = 1  # (this call is #1)
    assert g.broadcast(None, src=0, timeout=20.0) == "late but here"
    assert clock.now - 1000.0 == pytest.approx(7.0) and not g.broken


def test_the_error_names_every_rank_whose_answer_showed_another_call(monkeypatch):
    """Rank 0, the center of a star all_reduce, waits for ranks 1-3 and asks them 1 s in:
    rank 1 is in a gather, rank 2 returned from one, rank 3 is in this all_reduce (waiting
    for rank 0: no mismatch). One read brings the three answers: the error names 1 and 2."""
    clock = Clock()
    patch_clock(monkeypatch, clock)
    ep = ProbedEndpoint(clock, {0: [status_from(1, 0, "gather", 0, w.STATUS_IN_CALL)],
                                1: [status_from(2, 0, "gather", 0, w.STATUS_RETURNED)],
                                2: [status_from(3, 0, "all_reduce", w.NO_ROOT,
                                                w.STATUS_IN_CALL)]})
    g = group(0, 4, ep)
    monkeypatch.setattr(g._core, "_tell_peers", lambda *a, **k: None)
    with pytest.raises(ctrlcomm.MismatchTimeoutError) as e:
        g.all_reduce(1, op="sum", timeout=20.0)
    assert ep.asked == [(1.0, 1), (1.0, 2), (1.0, 3)]
    assert e.value.waiting_for == [1, 2, 3]
    assert e.value.mismatch.endswith("rank 1 called gather(root=0); rank 2 called "
                                     "gather(root=0)"), e.value.mismatch


def test_a_call_without_a_deadline_asks_early_too(monkeypatch):
    clock = Clock()
    patch_clock(monkeypatch, clock)
    ep = ProbedEndpoint(clock, {0: [status_from(0, 0, "gather", 0, w.STATUS_IN_CALL)]})
    g = group(1, 2, ep)
    monkeypatch.setattr(g._core, "_tell_peers", lambda *a, **k: None)
    with pytest.raises(ctrlcomm.MismatchTimeoutError):
        g.broadcast(None, src=0, timeout=float("inf"))
    assert ep.asked == [(1.0, 0)] and clock.now - 1000.0 == pytest.approx(1.0)


def test_each_call_asks_on_its_own_schedule_and_shows_only_its_own_answers(monkeypatch):
    """Call #0 asks 1 and 3 s in (the first answer: rank 0 is busy in #0), its message comes
    with the second; call #1 starts at once and asks 1 and 3 s into it, not 7: no answer to
    that, and at its deadline rank 0's state is not the answer #0 read. Nor when call #2 is
    told of a mismatch before it asked anyone."""
    clock = Clock()
    patch_clock(monkeypatch, clock)
    ep = ProbedEndpoint(clock, {
        0: [status_from(0, 0, "broadcast", 0, w.STATUS_IN_CALL)],
        1: [bcast_from(0, 0, "first")]})
    g = group(1, 2, ep)
    assert g.broadcast(None, src=0, timeout=20.0) == "first"
    assert ep.asked == [(1.0, 0), (3.0, 0)]
    with pytest.raises(ctrlcomm.CollectiveTimeoutError) as e:
        g.broadcast(None, src=0, timeout=5.0)
    assert [t for t, _ in ep.asked[2:]] == [4.0, 6.0, 7.75]  # 1 and 3 s into #1; deadline
    assert e.value.peer_states[0].startswith("did not answer"), e.value.peer_states

    ep = ProbedEndpoint(clock, {0: [status_from(0, 0, "broadcast", 0, w.STATUS_IN_CALL)],
                                1: [bcast_from(0, 0, "first")]})
    g = group(1, 2, ep)
    assert g.broadcast(None, src=0, timeout=20.0) == "first"
    ep.answers_due = [w.Message(w.ABORT, 0, GID, 1, w.ABORT_BY_PROBE,
                                payload=w.AbortReason(w.ABORT_MISMATCH, "#1 differs").encode())]
    with pytest.raises(ctrlcomm.MismatchTimeoutError) as e:
        g.broadcast(None, src=0, timeout=20.0)
    assert e.value.peer_states[0].startswith("not asked"), e.value.peer_states


def test_a_lost_ranks_report_with_odd_digits_names_only_ranks_of_the_group():
    # "²" passes str.isdigit() and int() refuses it: a bare ValueError came out of the
    # receive path; ranks out of the group were recorded as lost too
    g = group(0, 3, ScriptedEndpoint([]))
    c = g._core
    c._accept(w.Message(w.ABORT, 1, GID, 0, 0, 0, w.NO_ROOT, w.RAW,
                        "\x00lost:²,2,7,-1|rank 2 died".encode()))
    assert c.state == "broken"
    assert isinstance(c.cause, ctrlcomm.PeerLostError) and c.cause.ranks == [2]
    assert set(c.gone) == {2}
