"""How a group's core fails a call when it learns that the ranks are out of step, whatever
the order and grouping in which its reads deliver the messages that show it.

The core runs against a scripted in-memory endpoint (each drain delivers the next batch):
this tests the mailbox's decisions, not communication (tests/group does that with real
ranks over real sockets)."""

import pickle

import pytest

import ctrlcomm
from ctrlcomm import _wire as w
from ctrlcomm._core import MISMATCH_PREFIX, Core
from ctrlcomm._group import Group

GID = 7


class ScriptedEndpoint:
    STREAM = True
    closed = False
    key = None

    def __init__(self, batches, unflushed=False):
        self.batches = list(batches)
        self.unflushed = {"queued"} if unflushed else set()
        self.sent = []

    def send_framed(self, dsts, data):
        self.sent.append(list(dsts))

    def send_many(self, dsts, frames):
        self.sent.append(list(dsts))

    def send(self, dst, frames):
        pass

    def drain(self, sink):
        got = self.batches.pop(0) if self.batches else []
        for m in got:
            sink(m)
        return len(got)

    def wait(self, timeout):
        pass

    def backlog(self, dst):
        self.unflushed = set()
        return 0

    def pause(self, src):
        pass

    def resume(self, src):
        pass

    def close(self):
        pass


def group(rank, size, endpoint):
    core = Core(name="g", rank=rank, size=size, group_id=GID, endpoint=endpoint,
                codec=w.PICKLE, key=None, timeout=5.0)
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
    told = w.Message(w.ABORT, 0, GID, 0, 0, payload=(MISMATCH_PREFIX + "ranks differ").encode())
    g = group(1, 3, ScriptedEndpoint([[told, bcast_from(2, 0, "hello")]]))
    with pytest.raises(ctrlcomm.MismatchError, match=r"ranks differ \(reported by rank 0\)"):
        g.broadcast(None, src=2)
    assert g.broken


def test_a_late_mismatch_read_after_the_group_broke_still_fails_the_call():
    """Rank 1 broadcast as root in #0 and returned; in #1 one read brings a mismatch rank 0
    reported, rank 0's message of #0 naming another root, and rank 2's of #1."""
    told = w.Message(w.ABORT, 0, GID, 0, 0, payload=(MISMATCH_PREFIX + "elsewhere").encode())
    ep = ScriptedEndpoint([[told, bcast_from(0, 0, "x"), bcast_from(2, 1, "y")]])
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
    told = w.Message(w.ABORT, 0, GID, 0, w.ABORT_AT_DEADLINE,
                     payload=(MISMATCH_PREFIX + desc).encode())
    g = group(1, 3, ScriptedEndpoint([[told]]))
    with pytest.raises(ctrlcomm.MismatchTimeoutError) as e:
        g.broadcast(None, src=0)
    assert e.value.mismatch == desc and e.value.seq == 0 and e.value.op == "broadcast"
    assert e.value.waiting_for == [0] and "not asked" in e.value.peer_states[0]
    assert "(reported by rank 0, which found it at its deadline)" in str(e.value)
