"""Ranks out of step: a message of another call at this call's number, a peer's answer that it is
in another call, or a peer's word that it found one."""

from __future__ import annotations

from .. import _wire as w
from .._errors import (
    MismatchError,
    MismatchTimeoutError,
)
from .._lifecycle import OPEN
from ._common import (
    Active,
    describe,
)
from ._session import _Session


class _Mismatch(_Session):
    """Ranks out of step: a message of another call at this call's number, a peer's answer that it
    is in another call, or a peer's word that it found one."""

    def _set_mismatch(self, m: w.Message) -> None:
        a = self.active
        assert a is not None
        if self.mismatch is None:
            self.mismatch = MismatchError(self._mismatch_text(a.seq, a.op, a.root, m))

    def _mismatch_text(self, seq: int, op: int, root: int, m: w.Message) -> str:
        """That this rank called (op, root) as collective #seq, and ``m``'s sender another."""
        return (f"group {self.name!r}: collective #{seq} mismatch: rank {self.rank} called "
                f"{describe(op, root)}, rank {m.src} called {describe(m.op, m.root)}")

    def _told_mismatch(self, seq: int, desc: str, src: int) -> MismatchError:
        """The error of a mismatch in collective #``seq`` that rank ``src`` found by asking the
        ranks it waited for, and told: where this rank is in that collective, a
        :class:`MismatchTimeoutError` like the one it would raise on finding it itself (its
        call cannot complete either), else a :class:`MismatchError`."""
        told = f"{desc} (reported by rank {src}, which asked the ranks it waited for)"
        a = self.active
        if a is None or a.seq != seq:
            return MismatchError(told)
        name = a.name
        missing = list(self.waiting_for)
        # (what this rank's own probe heard, if it asked before it was told)
        states, detail = self._peer_states(missing,
                                           "not asked (told before this rank asked)")
        waiting = f" waiting for ranks {missing} ({detail})" if missing else ""
        return MismatchTimeoutError(
            f"{name} #{seq} on group {self.name!r} cannot complete on rank {self.rank}"
            f"{waiting}: {told}",
            mismatch=desc, op=name, seq=seq, group=self.name, waiting_for=missing,
            peer_states=states)

    def _late_mismatch(self, m: w.Message, past: Active) -> None:
        """A message of call #seq, which returned here, shows its sender called another
        collective or root there (both returned without waiting for each other: a broadcast
        whose ranks named different roots, say). This rank's result of it may be wrong: the
        group breaks, and the call in progress raises (or the next one)."""
        e = MismatchError(
            f"{self._mismatch_text(past.seq, past.op, past.root, m)} (found after "
            f"#{past.seq} had returned on rank {self.rank}: its result there may be wrong)")
        if self.state == OPEN:
            self._notify_mismatch(e)
            self.brk(e)
        self._fail_call(e)

    def _mismatch_desc(self, a: Active, missing: list[int]) -> str:
        """Which of ``missing`` said they are in (or returned from) another call than
        ``a`` (the active one: name, seq, op, root) at its seq, in words ("" if none): such a
        rank will never send what this one waits for."""
        seq = a.seq
        other = [(s, c) for s in missing if (c := self.status_call.get(s)) is not None
                 and c.seq == seq and (c.op, c.root) != (a.op, a.root)]
        if not other:
            return ""
        return (f"collective #{seq} mismatch on group {self.name!r}: rank {self.rank} called "
                f"{describe(a.op, a.root)}; "
                + "; ".join(f"rank {s} called {describe(op, root)}" for s, (_, op, root) in other))

    def _probed_mismatch(self, a: Active) -> MismatchTimeoutError:
        """The error of collective ``a`` (name, seq, op, root) when a rank it waits for
        answered that it is in another call at this seq: the call cannot complete, as at a
        timeout, and raises now."""
        name, seq = a.name, a.seq
        missing = list(self.waiting_for)
        states, detail = self._peer_states(missing, "not answered yet")
        desc = self._mismatch_desc(a, missing)
        return MismatchTimeoutError(
            f"{name} #{seq} on group {self.name!r} cannot complete on rank {self.rank} waiting "
            f"for ranks {missing} ({detail}): {desc}", mismatch=desc,
            op=name, seq=seq, group=self.name, waiting_for=missing, peer_states=states)

    def _peer_states(self, ranks: list[int],
                     unknown: str = "did not answer (not in a ctrlcomm call, or stuck)"
                     ) -> tuple[dict[int, str], str]:
        """What each of ``ranks`` answered it was doing, when last asked, and that in words
        (``rank 1: in ...; rank 2: ...``)."""
        now = self.seq
        states = {s: e.text if (e := self.status.get(s)) is not None and e.seq == now else unknown
                  for s in ranks}
        return states, "; ".join(f"rank {s}: {v}" for s, v in states.items())
