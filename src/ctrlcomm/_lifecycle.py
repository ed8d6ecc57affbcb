"""A group's states and every transition between them, in one table.

Theory of operation. A group is ``open`` from formation until the first thing that puts its
ranks out of step: that event breaks it (``broken``), and the first cause is kept: every
later call raises it (chained), on this rank, whatever broke it. A group is ``closed`` only
by its own rank's ``close()`` (or by being collected): a closed group stays closed. Nothing
else moves a group; in particular nothing mends a broken one (a new group is formed instead).

What breaks a group (:data:`CAUSES`), and what the call in progress raises then: these are
the one event ``BREAK``, with the error as its cause. Where the call that saw it raises,
and what later calls raise, is :class:`ctrlcomm._core.Core`'s (``check_open``,
``_cause_in``); which event is which, and where each state leads, is here.
"""

from __future__ import annotations

from ._errors import (
    CodecError,
    CollectiveTimeoutError,
    GroupBrokenError,
    GroupClosedError,
    MismatchError,
    PeerLostError,
)

OPEN, BROKEN, CLOSED = "open", "broken", "closed"
STATES = (OPEN, BROKEN, CLOSED)
BREAK, CLOSE = "break", "close"  # the events

# (state, event) -> the state after it: every pair there is
TRANSITIONS: dict[tuple[str, str], str] = {
    (OPEN, BREAK): BROKEN,  # the cause is kept
    (OPEN, CLOSE): CLOSED,  # the peers are told (a goodbye)
    (BROKEN, BREAK): BROKEN,  # a later cause is not kept: the first one explains the rest
    (BROKEN, CLOSE): CLOSED,
    (CLOSED, BREAK): CLOSED,  # a closed group stays closed (an abort of it does nothing)
    (CLOSED, CLOSE): CLOSED,  # close() again does nothing
}

# What a call made in each state raises (None: it runs)
CALL_RAISES: dict[str, type[BaseException] | None] = {
    OPEN: None,
    BROKEN: GroupBrokenError,  # PeerLostError (a subclass) where a peer was lost
    CLOSED: GroupClosedError,
}

# What breaks a group: the error the call that found it raises (later calls raise
# CALL_RAISES[BROKEN], caused by it)
CAUSES: dict[str, type[BaseException]] = {
    "a peer died, closed its group or aborted it": PeerLostError,
    "a peer was silent past the liveness timeout (stopped, hung, cut off)": PeerLostError,
    "the ranks called different collectives at one point": MismatchError,
    "a collective timed out": CollectiveTimeoutError,
    "a peer's object could not be decoded": CodecError,
    "this rank aborted it, or its collective was cancelled or interrupted": GroupBrokenError,
}


def after(state: str, event: str) -> str:
    """The state ``event`` leads ``state`` to (KeyError: not a state, or not an event)."""
    return TRANSITIONS[(state, event)]
