"""A group's state machine, tested from its table (ctrlcomm._lifecycle): every (state,
event) pair on a real group, and what a call raises in each state."""

import pytest

import ctrlcomm
from ctrlcomm import _lifecycle as lc
from ctrlcomm.testing import free_port, run_group


def _group():
    return ctrlcomm.Group.create("127.0.0.1", free_port(), 0, 1, name="life", timeout=10)


def _into(g, state):
    """Take an open group ``g`` to ``state`` the way a user does."""
    if state == lc.BROKEN:
        g.abort("into broken")
    elif state == lc.CLOSED:
        g.close()


def _event(g, event):
    if event == lc.BREAK:
        g.abort("the event")
    else:
        g.close()


@pytest.mark.parametrize(("state", "event"), sorted(lc.TRANSITIONS))
def test_every_transition_of_the_table_holds_on_a_real_group(state, event):
    g = _group()
    try:
        _into(g, state)
        assert g.stats()["state"] == state
        _event(g, event)
        assert g.stats()["state"] == lc.after(state, event)
        if lc.after(state, event) == lc.BROKEN:  # the first cause is kept
            with pytest.raises(lc.CALL_RAISES[lc.BROKEN],
                               match="into broken" if state == lc.BROKEN else "the event"):
                g.barrier()
    finally:
        g.close()


@pytest.mark.parametrize("state", lc.STATES)
def test_a_call_raises_what_the_table_says_in_each_state(state):
    g = _group()
    try:
        _into(g, state)
        raises = lc.CALL_RAISES[state]
        if raises is None:
            assert g.all_reduce(3) == 3
            g.barrier()
        else:
            with pytest.raises(raises):
                g.all_reduce(3)
            with pytest.raises(raises):
                g.barrier()
    finally:
        g.close()


def test_the_table_has_every_pair_and_only_its_states():
    assert set(lc.TRANSITIONS) == {(s, e) for s in lc.STATES for e in (lc.BREAK, lc.CLOSE)}
    assert set(lc.TRANSITIONS.values()) <= set(lc.STATES)
    assert set(lc.CALL_RAISES) == set(lc.STATES)


def _broken_by_a_peer(g):
    """Rank 1 aborts; rank 0's call raises what CAUSES says of a peer's abort, then each
    later call what CALL_RAISES says of a broken group (and the peer's close: nothing
    more)."""
    if g.rank == 1:
        g.abort("rank 1 gives up")
        return g.stats()["state"]
    with pytest.raises(lc.CAUSES["a peer died, closed its group or aborted it"]):
        g.barrier(timeout=10)
    state = g.stats()["state"]
    with pytest.raises(lc.CALL_RAISES[lc.BROKEN]):
        g.barrier()
    return state


def test_a_peers_abort_breaks_the_group_as_the_table_says():
    assert run_group(_broken_by_a_peer, 2, timeout=60) == [lc.BROKEN, lc.BROKEN]
