"""The one exception hierarchy of ctrlcomm.

::

    CtrlcommError
    ├── InvalidArgumentError (also ValueError)   bad input, raised before anything is sent
    ├── CollectiveTimeoutError (also TimeoutError) a deadline passed; names op, seq, missing ranks
    ├── MismatchError                             ranks called different collectives at one point
    │   └── MismatchTimeoutError (also CollectiveTimeoutError)  a deadline passed, and the
    │                                             ranks waited for said they are in another call
    ├── ReductionError (also ValueError)          a reduction failed (raised where the result goes)
    ├── ConcurrentUseError (also RuntimeError)    a collective of a second thread while one runs
    ├── GroupClosedError                          you closed it
    ├── GroupBrokenError                          a peer, a timeout or an abort broke it
    │   └── PeerLostError                         a peer died, stopped or became unreachable
    ├── FormationError                            the group could not be formed
    │   └── FormationTimeoutError (also TimeoutError)  names the ranks that never joined
    ├── StoreError                                rendezvous store failures
    │   └── StoreTimeoutError (also TimeoutError)
    └── CodecError (also TypeError)               an object the group's codec cannot encode

``WireError`` is internal: the wire decoder raises it for any malformed frame and the
mailbox counts and drops such frames; it never reaches user code.

``Failed`` is not raised: it is a failure carried as a value, in a call in place of a rank's
object, so that every rank stays in step and raises the error it stands for (a wire value:
both codecs encode it, which is why it lives here, below them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def show(value: Any, limit: int = 160) -> str:
    """``repr(value)`` for an error message: shortened, and never raising (a repr is user
    code, and an int of more than 4300 digits has none)."""
    try:
        text = repr(value)
    except Exception as e:
        return f"<a {type(value).__name__} whose repr raised {type(e).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class CtrlcommError(RuntimeError):
    """Base of every error ctrlcomm raises: a RuntimeError, as torch.distributed's errors
    are (code written for vLLM's StatelessProcessGroup or torch's stores catches those).

    Attributes:
        flight_record: where this error ended a call (a timeout, a mismatch, a lost peer,
            an abort told): the group's last calls on this rank, oldest first, the failed
            one last, as they were then (see :meth:`ctrlcomm.Group.flight_record`); else
            empty.
    """

    flight_record: Sequence[dict[str, Any]] = ()


class InvalidArgumentError(CtrlcommError, ValueError):
    """An argument was invalid. Raised before anything is sent: the group still works."""


class CollectiveTimeoutError(CtrlcommError, TimeoutError):
    """A call did not complete before its deadline.

    Attributes:
        op: the operation (``"all_reduce"``, ``"recv"``, ...).
        seq: its sequence number on the group (``None`` for point-to-point).
        group: the group's name.
        waiting_for: ranks this rank was still waiting for.
        peer_states: what each of those peers said it was doing, where it answered.
    """

    def __init__(
        self,
        message: str,
        *,
        op: str = "",
        seq: int | None = None,
        group: str = "",
        waiting_for: Sequence[int] = (),
        peer_states: dict[int, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.op = op
        self.seq = seq
        self.group = group
        self.waiting_for = list(waiting_for)
        self.peer_states = dict(peer_states or {})


class MismatchError(CtrlcommError):
    """Ranks called different collectives (or different roots) at the same point."""


class MismatchTimeoutError(MismatchError, CollectiveTimeoutError):
    """A call cannot complete: ranks it waits for, asked, said they were in (or had returned
    from) another collective, or the same with another root, at this sequence number. Where
    no rank gets a message of the other call (a ``gather`` whose ranks named different
    destinations, an ``all_reduce`` on one rank while the others wait in a ``broadcast``),
    that is how a mismatch shows. A collective that has waited 1 s asks the ranks it waits
    for which call they are in, again after 3, 7, 15... s and shortly before its deadline;
    the first rank to hear of another call raises this, before its deadline, and tells the
    others (a rank waiting in that call raises this too, at once; one that returned finds
    the group broken). Both a :class:`MismatchError` and a :class:`CollectiveTimeoutError`
    (with its attributes: a call that cannot complete is as good as timed out, and code
    that catches timeouts catches it).

    Attributes, besides those of :class:`CollectiveTimeoutError`:
        mismatch: which rank called what, e.g. ``"collective #3 mismatch on group 'ctrl':
            rank 0 called all_reduce(op='sum'); rank 1 called broadcast(root=0)"``.
    """

    def __init__(self, message: str, *, mismatch: str = "", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.mismatch = mismatch


class ReductionError(CtrlcommError, ValueError):
    """A reduction failed (shapes or types did not fit, or the op raised). Every rank that
    gets the result raises it (``all_reduce``: every rank; ``reduce``: the destination), and
    so does a rank whose own operand could not be reduced. The group still works.

    Attributes:
        ranks: where two operands (or partial results) could not be combined, the ranks
            whose operands they held, the left one's first, in the order combined (the
            message says which were on which side: "combining the operands of ranks 0-1
            with rank 2's"); with the flat and star plans (by default up to 8 ranks) ranks
            0..i, where rank i's operand was the first that did not combine with those
            before it. Empty
            where a rank's operand was refused before any combining (:class:`OperandError`,
            whose message names that rank).
    """

    def __init__(self, message: str = "", *, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks: list[int] = list(ranks)  # (a list, as PeerLostError's)


class OperandError(ReductionError, InvalidArgumentError):
    """A reduction failed because a rank's operand cannot be reduced by the op (a string to
    sum, a float to ``band``). It is an :class:`InvalidArgumentError` too. The rank with the
    operand still takes part in the call, so the others fail with it instead of waiting
    (or pairing with its next call)."""


class ConcurrentUseError(CtrlcommError, RuntimeError):
    """A collective was called from a second thread while another was in progress (or an
    awaited call found the group's sockets held by another thread for over a second)."""


class GroupClosedError(CtrlcommError):
    """The group was closed by this process."""


class GroupBrokenError(CtrlcommError):
    """The group can no longer be used: a timeout, mismatch, cancel, abort or lost peer."""


class PeerLostError(GroupBrokenError):
    """A peer died, stopped answering or became unreachable."""

    def __init__(self, message: str, *, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


class FormationError(CtrlcommError):
    """The group could not be formed (duplicate rank, store unreachable, ...)."""


class StoreError(CtrlcommError):
    """The rendezvous store failed or refused a request."""


class StoreKeyError(StoreError, KeyError):
    """A key the store does not hold, asked for without waiting (``get(key, wait=False)``):
    a KeyError too, as a dict's (and TCPStore's users expect)."""


class StoreQueueEmptyError(StoreError):
    """A store queue popped without waiting (``queue_pop(key, block=False)``) was empty
    (TCPStore's ``QueueEmptyError``)."""


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type (a store key that is neither str nor bytes): a
    TypeError too, as the builtin call (and TCPStore) raises."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A store request did not complete before its deadline: ``answered`` False where the
    store sent no reply at all (gone, or not reachable), True where it answered that the
    keys waited for were still missing."""

    def __init__(self, message: str, *, answered: bool = True) -> None:
        super().__init__(message)
        self.answered = answered


class CodecError(CtrlcommError, TypeError):
    """An object could not be encoded by the group's codec."""


class WireError(Exception):
    """Internal: a frame is malformed. Never raised into user code."""


class FormationTimeoutError(FormationError, TimeoutError):
    """Not every rank joined the group before the deadline: ``missing``, the ranks that did
    not join (as far as the store could tell), and ``gave_up``, those that joined and gave up
    before this rank's deadline (at their own, or on an error)."""

    def __init__(self, message: str, *, missing: Sequence[int] = (),
                 gave_up: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.missing = list(missing)
        self.gave_up = list(gave_up)


class FormationStoreTimeoutError(FormationTimeoutError, StoreTimeoutError):
    """Formation timed out because its store answered nothing (rank 0, which hosts it by
    default, did not come, or is gone; or a store run elsewhere is not running): caught as
    either."""

    def __init__(self, message: str, *, missing: Sequence[int] = (),
                 gave_up: Sequence[int] = ()) -> None:
        FormationTimeoutError.__init__(self, message, missing=missing, gave_up=gave_up)
        self.answered = False


# ------------------------------------------------------------ a failure as a value

class Failed:
    """A call that failed somewhere; carries the first error message, and its ``kind``:
    ``"reduction"`` (combining failed), ``"operand"`` (a rank's operand the op cannot
    reduce; see :func:`check_operand`), ``"codec"`` (a rank's object the group's codec
    cannot encode) or ``"argument"`` (a scatter root's or an all_to_all rank's objects are
    not one per rank). It travels in the call in place of the object, so every rank stays in
    step and raises it. ``sides``: for a combination that failed, the ranks whose operands
    were on its left and on its right (set by the plan that combined them, which alone
    knows; empty where not known)."""

    __slots__ = ("message", "kind", "sides")

    def __init__(self, message: str, kind: str = "reduction",
                 sides: tuple[tuple[int, ...], tuple[int, ...]] | tuple[()] = ()) -> None:
        self.message = message
        self.kind = kind
        self.sides = sides

    def __reduce__(self) -> tuple[Any, ...]:
        return (Failed, (self.message, self.kind, self.sides))

    def at(self, left: Sequence[int], right: Sequence[int]) -> Failed:
        """This failure, with the ranks of the combination it came from where it came from
        one and says none yet (a failure passed on keeps the sides of its own)."""
        if self.kind != "reduction" or self.sides:
            return self
        return Failed(self.message, self.kind, (tuple(left), tuple(right)))

    def where(self) -> str:
        """The sides as words: "combining the operands of ranks 0-1 with rank 2's"."""
        if not self.sides:
            return ""
        left, right = (rank_list(s) for s in self.sides)
        return f"combining the operand{'s' * (len(self.sides[0]) > 1)} of {left} with {right}'s"


def rank_list(ranks: Sequence[int]) -> str:
    """Ranks as words, runs shortened: "rank 3", "ranks 0-2, 5"."""
    rs = sorted(set(ranks))
    parts, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}{'-' if j > i + 1 else ', '}{rs[j]}")
        i = j + 1
    return f"rank{'s' * (len(rs) != 1)} {', '.join(parts)}"


# Pickles name a class by its module: a rank of a release before this one finds Failed in
# ctrlcomm._ops (which still exports it), and one of this release finds it there too.
Failed.__module__ = "ctrlcomm._ops"
