"""The store's pure state machine (no sockets)."""

import itertools

from ctrlcomm import _wire as w
from ctrlcomm.rendezvous._state import StoreState

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


# ------------------------------------------------------------------ formation and limits

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ctrlcomm.rendezvous._state import StoreLimits, _formation  # noqa: E402

NS = b"ctrlcomm/g/ctrlcomm:formation/"


def ok(reply):
    (_, rep), *_ = reply
    return rep.status == w.R_OK


def join(s, peer, rank, address=b"addr"):
    return s.handle(peer, req(w.S_CAS, [NS + b"rank/%d" % rank], [b"1", b"", address]), 0)


def test_only_the_ranks_that_joined_read_or_change_a_formation():
    s = StoreState()
    assert ok(join(s, b"r0", 0)) and ok(join(s, b"r1", 1))
    assert ok(s.handle(b"r0", req(w.S_SET, [NS + b"table"], [b"nonce secret\na\nb"]), 0))
    for op, keys, values in ((w.S_GET, [NS + b"table"], ()), (w.S_WAIT, [NS + b"table"], ()),
                             (w.S_CHECK, [NS + b"table"], ()),
                             (w.S_SET, [NS + b"table"], [b"forged"]),
                             (w.S_ADD, [NS + b"acks/x"], [b"1"]),
                             (w.S_DELETE, [NS + b"rank/0"], ())):
        (_, rep), = s.handle(b"stranger", req(op, keys, values, timeout=5), 0)
        assert rep.status == w.R_ERROR and b"has not joined" in rep.values[0], (op, rep)
    # a member reads all of it, changes its own rank's key only
    assert s.handle(b"r1", req(w.S_GET, [NS + b"table", NS + b"rank/0"]), 0)[0][1].values \
        == (b"nonce secret\na\nb", b"addr")
    for op, key, values in ((w.S_DELETE, b"rank/0", ()), (w.S_SET, b"table", [b"x"]),
                            (w.S_SET, b"secret/0", [b"x"]), (w.S_GET, b"secret/0", ())):
        (_, rep), = s.handle(b"r1", req(op, [NS + key], values), 0)
        assert rep.status == w.R_ERROR and b"not this client's" in rep.values[0], key
    # the secrets: rank 0 writes each; rank r reads its own only
    assert ok(s.handle(b"r0", req(w.S_SET, [NS + b"secret/1"], [b"s1"]), 0))
    assert s.handle(b"r1", req(w.S_GET, [NS + b"secret/1"]), 0)[0][1].values == (b"s1",)
    assert ok(join(s, b"x", 7))  # (a rank the group does not have: a member, and no more)
    (_, rep), = s.handle(b"x", req(w.S_GET, [NS + b"secret/1"], timeout=1), 0)
    assert rep.status == w.R_ERROR
    assert ok(s.handle(b"x", req(w.S_DELETE, [NS + b"rank/7"]), 0))
    assert ok(s.handle(b"r1", req(w.S_DELETE, [NS + b"secret/1"]), 0))
    # list_keys and delete_prefix pass over what the client may not touch
    (listed,) = s.handle(b"stranger", req(w.S_LIST_KEYS, [b""]), 0)[0][1].values
    assert listed == b""
    assert s.handle(b"stranger", req(w.S_DELETE_PREFIX, [b""]), 0)[0][1].values == (b"0",)
    assert s.handle(b"r1", req(w.S_DELETE_PREFIX, [NS]), 0)[0][1].values == (b"1",)  # (its key)
    # a rank's key taken already: the latecomer is not a member (and is told who holds it)
    (_, rep), = join(s, b"late", 0, b"other")
    assert rep.status == w.R_CAS_FAIL and rep.values == (b"addr",)
    (_, rep), = s.handle(b"late", req(w.S_GET, [NS + b"rank/1"]), 0)
    assert rep.status == w.R_ERROR
    # the formation's last key gone: who had joined it is forgotten
    assert ok(s.handle(b"r0", req(w.S_DELETE, [NS + b"table", NS + b"rank/0"]), 0))
    assert s.members == {} and s.owners == {} and s.formation_keys == {}
    assert ok(join(s, b"next", 0))  # (the next formation of that name)


def test_a_write_past_a_limit_is_refused_naming_it_and_the_store_goes_on():
    s = StoreState(StoreLimits(max_value_bytes=100, max_total_bytes=1000, max_keys=5,
                               max_waiters=2))
    for k, v, why in ((b"big", b"x" * 101, b"max_value_bytes"),):
        (_, rep), = s.handle(b"p", req(w.S_SET, [k], [v]), 0)
        assert rep.status == w.R_ERROR and why in rep.values[0]
    for i in range(9):
        s.handle(b"p", req(w.S_SET, [b"k%d" % i], [b"x" * 100]), 0)
    assert len(s.data) == 5 and s.held <= 1000
    (_, rep), = s.handle(b"p", req(w.S_QUEUE_PUSH, [b"q"], [b"v"]), 0)
    assert rep.status == w.R_ERROR and b"max_keys" in rep.values[0]
    assert ok(s.handle(b"p", req(w.S_DELETE, [b"k0", b"k1", b"k2", b"k3"]), 0))
    (_, rep), = s.handle(b"p", req(w.S_SET, [b"k"], [b"x" * 100]), 0)
    assert rep.status == w.R_OK
    assert s.handle(b"a", req(w.S_GET, [b"never"], timeout=9), 0) == []
    assert s.handle(b"b", req(w.S_GET, [b"never"], timeout=9), 0) == []
    (_, rep), = s.handle(b"c", req(w.S_GET, [b"never"], timeout=9), 0)
    assert rep.status == w.R_ERROR and b"max_waiters" in rep.values[0]
    # a client's new request takes the place of its own that waits
    assert s.handle(b"a", req(w.S_WAIT, [b"never2"], timeout=9), 0) == []
    assert len(s.waiters) == 2


def _held(s):
    return (sum(len(k) + len(v) for k, v in s.data.items())
            + sum(len(k) + sum(map(len, q)) for k, q in s.queues.items())
            + sum(wt.size for wt in s.waiters))


_peers = st.sampled_from([b"r0", b"r1", b"x"])
_keys = st.sampled_from([b"a", b"b", NS + b"rank/0", NS + b"rank/1", NS + b"table", b"q"])
_ops = st.tuples(_peers, st.sampled_from([w.S_SET, w.S_GET, w.S_ADD, w.S_CAS, w.S_DELETE,
                                          w.S_WAIT, w.S_QUEUE_PUSH, w.S_QUEUE_POP,
                                          w.S_DELETE_PREFIX, w.S_CHECK]),
                 _keys, st.binary(max_size=40), st.booleans(), st.floats(0, 3))


@settings(max_examples=300, deadline=None)
@given(st.lists(_ops, max_size=40))
def test_the_store_never_holds_past_its_limits_nor_shows_a_formation_to_a_stranger(ops):
    lim = StoreLimits(max_value_bytes=30, max_total_bytes=200, max_keys=4, max_waiters=3)
    s = StoreState(lim)
    now = 0.0
    for i, (peer, op, key, value, absent, dt) in enumerate(ops):
        now += dt
        values = {w.S_SET: [value], w.S_ADD: [b"1"], w.S_QUEUE_PUSH: [value],
                  w.S_CAS: [b"1" if absent else b"0", b"", value]}.get(op, [])
        keys = [key[:1] if op == w.S_DELETE_PREFIX else key]
        out = s.handle(peer, req(op, keys, values, timeout=1.0, rid=i), now) + s.expire(now)
        for who, rep in out:
            f = _formation(keys[0])
            if who == peer and f is not None and rep.status == w.R_OK and op == w.S_GET:
                assert peer in s.members.get(f[0], ()), (peer, keys)
        assert s.held == _held(s) <= lim.max_total_bytes
        assert len(s.data) + s.queued <= lim.max_keys and len(s.waiters) <= lim.max_waiters
        for k, owner in s.owners.items():
            assert k in s.data and owner in s.members[_formation(k)[0]]


def test_limits_are_checked():
    for bad in (dict(max_keys=0), dict(max_total_bytes=-1), dict(max_connections=1.5),
                dict(max_value_bytes=w.STORE_MAX_VALUE + 1)):
        with pytest.raises(ValueError, match="StoreLimits"):
            StoreLimits(**bad)
