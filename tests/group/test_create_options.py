"""Group.create's options in the forms torch users pass them."""

import datetime

import pytest

import ctrlcomm
from ctrlcomm.testing import free_port, run_group


def _sum(g):
    return g.all_reduce(g.rank + 1)


def test_durations_may_be_timedeltas():
    td = datetime.timedelta
    got = run_group(_sum, 2, group_kwargs={"heartbeat_interval": td(milliseconds=200),
                                           "liveness_timeout": td(seconds=5),
                                           "timeout": td(seconds=20)})
    assert got == [3, 3]


def test_the_arguments_are_checked_in_the_order_of_the_signature():
    """(A call with several bad arguments is told of the first, as it was.)"""
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="unknown codec"):
        ctrlcomm.Group.create("127.0.0.1", -1, 0, 1, codec="nope")
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="port"):
        ctrlcomm.Group.create("127.0.0.1", -1, 0, 1, auth_key=b"")
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="heartbeat_interval"):
        ctrlcomm.Group.create("127.0.0.1", free_port(), 0, 1, heartbeat_interval=0)
