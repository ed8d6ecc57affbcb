"""When a long wait warns, and what its warning says (ctrlcomm._patience)."""

import logging
import math
import time

from ctrlcomm import _patience as p


def test_the_first_warning_comes_after_a_tenth_of_the_timeout_within_bounds():
    assert p.first_warning(300) == 30
    assert p.first_warning(100) == 10
    assert p.first_warning(20) == 5  # (at least 5 s: a short wait is not a long one)
    assert p.first_warning(3000) == 30
    assert p.first_warning(None) == p.first_warning(math.inf) == 30


def test_each_next_warning_comes_after_twice_the_wait_so_far(caplog):
    pat = p.Patience("formation of 'x', rank 0", 300.0, start=100.0)
    assert not pat.due(129.9) and pat.due(130.0) and pat.left(120.0) == 10.0
    times = []
    with caplog.at_level(logging.WARNING, logger="ctrlcomm"):
        now = 130.0
        for _ in range(4):
            assert pat.due(now)
            pat.say("ranks [3] to join", now)
            times.append(now - 100)
            now = pat.next
    assert times == [30, 60, 120, 240]
    assert caplog.messages[0] == ("formation of 'x', rank 0: 30 s of 300 s, waiting for "
                                  "ranks [3] to join")


def test_a_wait_without_a_timeout_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="ctrlcomm"):
        p.waited("barrier #0 on group 'g', rank 1", 31.2, None, "ranks [0]")
        p.waited("barrier #0 on group 'g', rank 1", 31.2, math.inf, "ranks [0]")
    assert caplog.messages == ["barrier #0 on group 'g', rank 1: 31 s, waiting for ranks [0]"] * 2


def test_a_watch_warns_from_its_thread_what_the_waiting_thread_noted(caplog):
    with p.Watch("formation of 'w', rank 2", 300.0, "the store") as w:
        assert 29 < p.until_due() <= 30
        p.note("rank 0 to join")
        assert w.waiting_for == "rank 0 to join"
    assert p.until_due() == math.inf  # (the watch ended with its block)
    p.note("nobody listens")  # (no watch: nothing to tell, and no error)
    w = p.Watch("formation of 'w', rank 2", 300.0, "the store")
    w.patience.next = w.patience.start  # (due at once: its thread says it as it starts)
    with caplog.at_level(logging.WARNING, logger="ctrlcomm"), w:
        for _ in range(300):
            if caplog.messages:
                break
            time.sleep(0.01)
    assert caplog.messages[0].startswith("formation of 'w', rank 2: 0 s of 300 s, waiting for "
                                         "the store")
