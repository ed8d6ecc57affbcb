"""The store's pure state machine (no sockets)."""

import itertools

from ctrlcomm import _wire as w
from ctrlcomm._store import StoreState

_ids = itertools.count(100)


def req(op, keys, values=(), timeout=0.0, rid=None):
    return w.StoreRequest(op, next(_ids) if rid is None else rid, timeout, tuple(keys),
                          tuple(values))


def test_set_get_add_delete():
    s = StoreState()
    assert s.handle(b"p", req(w.S_SET, [b"k"], [b"v"]), 0)[0][1].status == w.R_OK
    assert s.handle(b"p", req(w.S_GET, [b"k"]), 0)[0][1].values == (b"v",)
    assert s.handle(b"p", req(w.S_ADD, [b"n"], [b"5"]), 0)[0][1].values == (b"5",)
    assert s.handle(b"p", req(w.S_ADD, [b"n"], [b"-2"]), 0)[0][1].values == (b"3",)
    assert s.handle(b"p", req(w.S_DELETE, [b"k", b"zz"]), 0)[0][1].values == (b"1",)


def test_num_keys_counts_every_key_and_list_keys_those_under_a_prefix():
    s = StoreState()
    for k in (b"a/1", b"a/22", b"b/1", b"a"):
        s.handle(b"p", req(w.S_SET, [k], [b"v"]), 0)
    assert s.handle(b"p", req(w.S_NUM_KEYS, []), 0)[0][1].values == (b"4",)
    (listed,) = s.handle(b"p", req(w.S_LIST_KEYS, [b"a/"]), 0)[0][1].values
    assert listed == b"\x03\x00\x00\x00a/1" + b"\x04\x00\x00\x00a/22"
    assert s.handle(b"p", req(w.S_LIST_KEYS, [b"zz"]), 0)[0][1].values == (b"",)
    frames = w.encode_store_request(req(w.S_LIST_KEYS, [b"a/"]))  # (the wire knows them)
    assert w.decode_store_request(frames).op == w.S_LIST_KEYS


def test_queues_first_in_first_out_apart_from_the_keys():
    s = StoreState()
    for v in (b"a", b"b"):
        assert s.handle(b"p", req(w.S_QUEUE_PUSH, [b"q"], [v]), 0)[0][1].status == w.R_OK
    assert s.handle(b"p", req(w.S_QUEUE_LEN, [b"q"]), 0)[0][1].values == (b"2",)
    assert b"q" not in s.data and s.handle(b"p", req(w.S_NUM_KEYS, []), 0)[0][1].values == (b"0",)
    assert s.handle(b"p", req(w.S_QUEUE_POP, [b"q"]), 0)[0][1].values == (b"a",)
    assert s.handle(b"p", req(w.S_QUEUE_POP, [b"q"]), 0)[0][1].values == (b"b",)
    (_, empty), = s.handle(b"p", req(w.S_QUEUE_POP, [b"q"]), 0)  # (no wait: answered now)
    assert empty.status == w.R_TIMEOUT and empty.values == (b"q",)
    assert s.queues == {} and s.queued == 0  # (an emptied queue leaves nothing behind)
    for op in (w.S_QUEUE_PUSH, w.S_QUEUE_POP, w.S_QUEUE_LEN):  # (the wire knows them)
        assert w.decode_store_request(w.encode_store_request(req(op, [b"q"]))).op == op


def test_a_push_wakes_every_parked_pop_and_stays_queued_until_one_pops_it():
    # (before: the first parked pop was handed the value, and it was lost where that pop's
    # client had gone or given up: killed, interrupted, closed, past its deadline)
    s = StoreState()
    assert s.handle(b"a", req(w.S_QUEUE_POP, [b"q"], timeout=5, rid=1), 0.0) == []
    assert s.handle(b"b", req(w.S_QUEUE_POP, [b"q"], timeout=2, rid=2), 0.0) == []
    assert s.next_deadline() == 2.0
    out = s.handle(b"p", req(w.S_QUEUE_PUSH, [b"q"], [b"v1"], rid=4), 1.0)
    assert sorted(out) == sorted([(b"p", w.StoreReply(w.R_OK, 4)), (b"a", w.StoreReply(w.R_OK, 1)),
                                  (b"b", w.StoreReply(w.R_OK, 2))])  # (woken: no value)
    assert s.n_poppers() == 0 and s.queued == 1 and s.next_deadline() is None
    # a wake-up resent (its reply lost) is answered again, and takes nothing
    assert s.handle(b"b", req(w.S_QUEUE_POP, [b"q"], timeout=2, rid=2), 1.5) == \
        [(b"b", w.StoreReply(w.R_OK, 2))] and s.queued == 1
    # the woken pops pop again: one takes the value, the other parks again, and expires
    assert s.handle(b"b", req(w.S_QUEUE_POP, [b"q"], timeout=1, rid=5), 1.5) == \
        [(b"b", w.StoreReply(w.R_OK, 5, (b"v1",)))]
    assert s.handle(b"a", req(w.S_QUEUE_POP, [b"q"], timeout=1, rid=6), 1.5) == []
    assert s.expire(2.4) == []
    assert s.expire(2.5) == [(b"a", w.StoreReply(w.R_TIMEOUT, 6, (b"q",)))]
    assert s.n_poppers() == 0 and s.queued == 0
    # a pop parked by a client that then went: a push stays queued, for someone else
    assert s.handle(b"c", req(w.S_QUEUE_POP, [b"q"], timeout=9, rid=7), 3.0) == []
    s.handle(b"p", req(w.S_QUEUE_PUSH, [b"q"], [b"v2"], rid=8), 3.0)
    assert s.handle(b"p", req(w.S_QUEUE_LEN, [b"q"]), 3.0)[0][1].values == (b"1",)
    # a pop resent (its reply lost) is answered again, not given the next value
    s.handle(b"p", req(w.S_QUEUE_PUSH, [b"q"], [b"v3"], rid=9), 3.0)
    first = s.handle(b"a", req(w.S_QUEUE_POP, [b"q"], rid=10), 3.0)
    assert first == s.handle(b"a", req(w.S_QUEUE_POP, [b"q"], rid=10), 3.0)
    assert first[0][1].values == (b"v2",) and s.queued == 1


def test_waiting_get_is_answered_by_a_later_set_or_expires():
    s = StoreState()
    assert s.handle(b"a", req(w.S_GET, [b"x", b"y"], timeout=5, rid=9), 0.0) == []
    assert s.next_deadline() == 5.0
    s.handle(b"b", req(w.S_SET, [b"x"], [b"1"]), 1.0)
    out = s.handle(b"b", req(w.S_SET, [b"y"], [b"2"]), 1.0)
    assert (b"a", w.StoreReply(w.R_OK, 9, (b"1", b"2"))) in out
    s.handle(b"a", req(w.S_WAIT, [b"z"], timeout=2, rid=10), 1.0)
    assert s.expire(2.0) == []
    (peer, rep), = s.expire(3.0)
    assert peer == b"a" and rep.status == w.R_TIMEOUT and rep.values == (b"z",)


def test_compare_set():
    s = StoreState()
    ok = s.handle(b"p", req(w.S_CAS, [b"k"], [b"1", b"", b"first"]), 0)[0][1]
    assert ok.status == w.R_OK
    again = s.handle(b"p", req(w.S_CAS, [b"k"], [b"1", b"", b"second"]), 0)[0][1]
    assert again.status == w.R_CAS_FAIL and again.values == (b"first",)
    swap = s.handle(b"p", req(w.S_CAS, [b"k"], [b"0", b"first", b"third"]), 0)[0][1]
    assert swap.status == w.R_OK and s.data[b"k"] == b"third"


def test_bad_requests_are_refused_not_raised():
    s = StoreState()
    assert s.handle(b"p", req(w.S_ADD, [b"k"], [b"notanint"]), 0)[0][1].status == w.R_ERROR
    assert s.handle(b"p", req(w.S_SET, [b"a", b"b"], [b"v"]), 0)[0][1].status == w.R_ERROR
    assert s.handle(b"p", req(w.S_SET, [b"k" * 5000], [b"v"]), 0)[0][1].status == w.R_ERROR


def test_delete_prefix():
    s = StoreState()
    for k in (b"g/a", b"g/b", b"h/a"):
        s.handle(b"p", req(w.S_SET, [k], [b"v"]), 0)
    assert s.handle(b"p", req(w.S_DELETE_PREFIX, [b"g/"]), 0)[0][1].values == (b"2",)
    assert list(s.data) == [b"h/a"]


def test_a_resent_request_is_answered_again_never_applied_twice():
    s = StoreState()
    add = req(w.S_ADD, [b"n"], [b"1"], rid=5)
    first = s.handle(b"p", add, 0)
    assert s.handle(b"p", add, 0) == first
    assert s.data[b"n"] == b"1"
    assert s.handle(b"q", req(w.S_ADD, [b"n"], [b"1"], rid=5), 0)[0][1].values == (b"2",)
    wait = req(w.S_GET, [b"later"], timeout=5, rid=6)
    assert s.handle(b"p", wait, 0) == [] and s.handle(b"p", wait, 0) == []
    assert len(s.waiters) == 1
    s.handle(b"q", req(w.S_SET, [b"later"], [b"v"]), 1)
    assert s.handle(b"p", wait, 1) == [(b"p", w.StoreReply(w.R_OK, 6, (b"v",)))]


def test_check_and_a_parked_wait_see_a_queue_that_holds_values_as_tcpstores_do():
    s = StoreState()
    assert s.handle(b"a", req(w.S_WAIT, [b"q"], timeout=5, rid=1), 0.0) == []
    assert s.handle(b"c", req(w.S_CHECK, [b"q"], rid=2), 0.0)[0][1].values == (b"0",)
    out = s.handle(b"p", req(w.S_QUEUE_PUSH, [b"q"], [b"v"], rid=3), 1.0)
    assert (b"a", w.StoreReply(w.R_OK, 1)) in out and s.waiters == []
    assert s.handle(b"c", req(w.S_CHECK, [b"q"], rid=4), 1.0)[0][1].values == (b"1",)
    assert s.handle(b"c", req(w.S_GET, [b"q"], rid=5), 1.0)[0][1].values == (b"",)
    s.handle(b"c", req(w.S_QUEUE_POP, [b"q"], rid=6), 1.0)
    assert s.handle(b"c", req(w.S_CHECK, [b"q"], rid=7), 1.0)[0][1].values == (b"0",)
