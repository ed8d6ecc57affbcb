"""The awaited path, in one module: the asyncio driver (:func:`run_async`) with the turn queue of
an event loop's collectives, and the coroutine an awaited call returns (:class:`_Awaited`),
which breaks the group where it is cancelled before it began. The endpoints' own waits
(``Endpoint.wait_async``: a reader callback on the socket) are the transports'."""

from __future__ import annotations

import asyncio
import inspect
import math
import warnings
from collections.abc import Callable, Coroutine, Generator
from typing import Any, TypeVar

from ._core import (
    DRIVER_CODES,
    IO_TAKE_S,
    Core,
    Follower,
    Wait,
    _get_ident,
    _monotonic,
)
from ._endpoint import (
    FAIR_S,
    turn_due,
    wake_future,
)
from ._errors import (
    CollectiveTimeoutError,
    ConcurrentUseError,
)
from ._lifecycle import OPEN


class _Awaited(Coroutine[Any, Any, Any]):
    """An awaited collective's coroutine, which knows whether it began.

    The coroutine of an ``async def`` that is cancelled before its first step (a task
    cancelled as it is made, ``asyncio.wait_for(..., 0)``, a deadline already spent) is
    closed without running any of its body: nothing would know of the call, the group
    would stay open, and this rank's next collective would pair with the others' this one
    (two all_gathers would give ``["second", "first"]`` on both ranks). asyncio runs
    this as it runs a coroutine (``send``/``throw``), so a cancellation before it began
    reaches it: the group breaks, and the others are told, as for one cancelled in its
    first turn (:func:`cancelled_before_it_began`). The call itself (its arguments
    checked) is made as it begins, as an ``async def``'s would be."""

    def __init__(self, core: Core, name: str, make: Callable[[], Coroutine[Any, Any, Any]],
                 owner: str = "AioGroup") -> None:
        self._core = core
        self._make: Callable[[], Coroutine[Any, Any, Any]] | None = make
        self._coro: Coroutine[Any, Any, Any] | None = None
        self.__name__ = name
        self.__qualname__ = f"{owner}.{name}"

    def _begun(self) -> Coroutine[Any, Any, Any]:
        coro = self._coro
        if coro is None:
            make, self._make = self._make, None
            if make is None:
                raise RuntimeError(f"cannot reuse already awaited coroutine {self.__qualname__}")
            coro = self._coro = make()
        return coro

    def send(self, value: Any) -> Any:
        return self._begun().send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if self._coro is None:
            if self._make is not None:
                self._make = None
                cancelled_before_it_began(self._core, self.__name__)
            e = typ if isinstance(typ, BaseException) else typ() if val is None else val
            raise e.with_traceback(tb) if tb is not None else e
        if val is None and tb is None:  # (the form asyncio uses; three are deprecated)
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)

    def close(self) -> None:
        # (never awaited: no call was made, as with an async def's coroutine)
        self._make = None
        if self._coro is not None:
            self._coro.close()

    def __del__(self) -> None:
        if getattr(self, "_make", None) is not None:  # (as Python says of an async def's)
            warnings.warn(f"coroutine '{self.__qualname__}' was never awaited",
                          RuntimeWarning, stacklevel=2)

    def __await__(self) -> Generator[Any, None, Any]:
        return self._begun().__await__()


_F = TypeVar("_F", bound=Callable[..., Any])


def _coroutine_function(fn: _F) -> _F:
    """Mark ``fn``, which returns an :class:`_Awaited`, as a coroutine function for the
    code that asks (``inspect.iscoroutinefunction`` from Python 3.12,
    ``asyncio.iscoroutinefunction``), as the ``async def`` it was."""
    mark = getattr(inspect, "markcoroutinefunction", None)
    if mark is not None:
        return mark(fn)  # type: ignore[no-any-return]
    marker = getattr(asyncio.coroutines, "_is_coroutine", None)
    if marker is not None:
        fn._is_coroutine = marker  # type: ignore[attr-defined]
    return fn


async def _take_io(core: Core, gen: Wait, collective: str) -> bool:
    """(run_async, finding the endpoint's ``io`` held.) Whether it is taken: waited for in
    the event loop, up to IO_TAKE_S (its holder, a call of another thread, runs a moment
    between waits; a copy held at a fork never lets it go); a collective not where another
    is in progress when it looks, first and at each release (refused, as the group would
    refuse it). A call cancelled meanwhile has not begun (cancelled_before_it_began)."""
    try:
        return await core.ep.io.acquire_async(
            IO_TAKE_S, core.collective_in_progress if collective else _never)
    except BaseException:
        gen.close()
        cancelled_before_it_began(core, collective)
        raise


def _never() -> bool:
    return False


def cancelled_before_it_began(core: Core, collective: str, how: str = "was cancelled"
                              ) -> None:
    """An awaited collective ``collective`` (a name; "": a point-to-point call) was
    cancelled before it began: the group breaks, as where one is cancelled while it runs
    (the others are told). Its caller cannot tell the two apart, and a rank that went on
    would pair its next collective with the others' this one. Where an awaited collective
    of this event loop has the turn (run_async), this one would have waited for it and
    been made: the group breaks once that one has ended (_pass_turn), which the others
    made too. Not where another collective is in progress otherwise (another thread's,
    say): this one would have been refused (ConcurrentUseError), which leaves the group
    working (and breaking it would end that call); nor in a world of one."""
    if not collective or core.state != OPEN or core.size <= 1:
        return
    why = (f"{collective} on group {core.name!r} {how} on rank {core.rank} before it began "
           "(queued behind another collective of its event loop)")
    held = core._turn.get(0)
    if held is not None and held[0] == _get_ident() and held[1] is asyncio._get_running_loop():
        core._owed = core._owed or why
    elif not core._owner:
        core.abort(f"{collective} #{core.seq} on group {core.name!r} {how} "
                   f"on rank {core.rank} (before it began)")


def _pass_turn(core: Core, turn: tuple[int, asyncio.AbstractEventLoop]) -> None:
    """(An awaited collective's turn ends, in its loop.) The next one queued in that loop
    is woken, the turn its (first come, first served: one that starts meanwhile queues
    behind it); else the turn is free."""
    box = core._turn
    if box.get(0) != turn:
        return
    q = core._turns
    while q and q[0].done():
        # a call queued next that gave up (its timer, or a cancellation, settled its future
        # before its task could run _queue_turn's handling: this may run first, in the
        # same pass of the loop): not made here, though the others make it
        f = q.popleft()
        if not f.cancelled():
            f.exception()  # (retrieved: _TurnTimeout)
        core._owed = core._owed or (
            f"a collective on group {core.name!r} queued on rank {core.rank} behind another "
            "of its event loop was cancelled or timed out before it began")
    if core._owed:  # (a collective queued behind this one was not made: see there)
        why, core._owed = core._owed, ""
        core.abort(why)
    if q:
        q.popleft().set_result(None)  # (not done: those were taken above)
        return
    del box[0]  # (ours: another thread only ever adds it where absent)


class _TurnTimeout(Exception):
    """(_queue_turn's timer fired.)"""


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(_TurnTimeout())


async def _queue_turn(core: Core, collective: str, timeout: float | None,
                      turn: tuple[int, asyncio.AbstractEventLoop]) -> None:
    """Wait for the turn while another awaited collective of this event loop has it, up to
    ``timeout`` (the group's default for None). Cancelled, or past it, the call is not made
    here, though the others would make it: the group breaks once the holder's call has
    ended (cancelled_before_it_began). (Its own future and timer, not asyncio.wait_for: on
    Python 3.10 and 3.11 that returns the result, the cancellation lost, where a task is
    cancelled as the future completes, CPython gh-86296: the call then ran.)"""
    loop = turn[1]
    fut = loop.create_future()
    core._turns.append(fut)
    t = core.timeout if timeout is None else timeout
    timer = None if math.isinf(t) else loop.call_later(t, _expire, fut)
    try:
        await fut
    except BaseException as e:
        timed_out = isinstance(e, _TurnTimeout)
        # (first: the turn's holder, this call where handed the turn as it gave up, breaks
        # the group as it passes the turn on)
        cancelled_before_it_began(core, collective, "timed out" if timed_out else
                                  "was cancelled")
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            _pass_turn(core, turn)  # (handed the turn as it gave up: to the next)
        elif not fut.done():
            fut.cancel()  # (passed over in the queue)
        if timed_out:
            raise CollectiveTimeoutError(
                f"{collective} on group {core.name!r} timed out after {t:g} s on rank "
                f"{core.rank} queued behind {core._owner or 'another call'}, another task's "
                "of this event loop: not made here, though the others may make it, so the "
                "group breaks once that call has ended", op=collective,
                group=core.name) from None
        raise
    finally:
        if timer is not None:
            timer.cancel()


async def run_async(core: Core, gen: Wait, collective: str = "",
                    timeout: float | None = None) -> Any:
    """Asyncio driver: as :func:`run_sync`, but waits through the event loop.

    A call whose messages were read already completes without suspending, as
    ``asyncio.Queue.get`` does when the queue holds something; but its endpoint reads the
    sockets itself, so a task awaiting such calls back to back, from a peer that keeps
    sending, would never let the loop run (other tasks, timeouts, cancellation: seen 1.4 s
    for 60,000 messages). So a call started right after the last one ended, when the loop
    has had no turn through this endpoint for FAIR_S, gives it one first, before it takes
    anything (a cancellation there loses nothing). A call started later, or one that waited
    through the loop, costs nothing more. While such a turn is pending, a call that starts
    (another task's, scheduled in the same pass of the loop) takes one too, behind it: the
    calls keep the order the tasks started them in (two sends gathered stay in order, and
    the second does not find the group taken by a third).

    ``collective``: the name of the collective ``gen`` runs. One cancelled in that turn,
    before it began, breaks the group as one cancelled while it runs does (the others are
    told): its caller cannot tell the two apart, and a rank that went on would pair its
    next collective with the others' this one.

    Awaited collectives of one event loop take turns, first come first: one started while
    another (another task's) has the turn waits for it, up to ``timeout`` (the call's:
    its own deadline starts as it begins). So collectives gathered with asyncio.gather run
    on every rank in the order their tasks started, as torch's async_op works queue (where
    one were refused on a rank where the other waited, and run on a rank where the other
    had not had to wait, it would pair with the wrong call, silently). (The
    order is the one in which calls reach the group: where a task makes several in a row,
    another task's may come between them on one rank and not on another.) A call
    cancelled or timed out while queued is not made here, though the others may make it:
    the group breaks once the holder's call has ended (cancelled_before_it_began). A turn
    left by a loop closed before its call could end is taken over. Point-to-point calls run
    beside any other (the core's docstring); a collective of another thread is refused while
    one is in progress. A call that finds the sockets held by another thread's call, which
    runs a moment between its waits, waits for them in the loop (_take_io)."""
    turn = await _take_turn(core, gen, collective, timeout) if collective else None
    ep = core.ep
    try:
        if ep.yielding or (_monotonic() - ep.ended < FAIR_S and turn_due(ep)):
            await _give_the_loop_a_turn(core, collective)
        # (ep.io: held while the call runs, released while it is suspended in a wait: see
        # Core._abort_suspended)
        io = ep.io
        if not io.acquire(False) and not await _take_io(core, gen, collective):
            # a collective's, another thread's collective in progress (refused at once, as
            # the group would refuse it, without blocking this loop); or held past
            # IO_TAKE_S (a long reduction callable in another thread's collective step, a
            # copy held by a thread of the parent that forked this process)
            gen.close()
            raise ConcurrentUseError(
                f"group {core.name!r} (rank {core.rank}) is busy with "
                f"{core._owner or 'a call'} in another thread: collectives run one at a "
                "time, and its sockets are held while a call runs")
        try:
            delay = next(gen)
            while True:
                try:
                    if type(delay) is Follower:
                        await _follow(io, delay)
                    else:
                        await ep.wait_async(delay)
                except BaseException:  # cancelled: let the generator record what that means
                    gen.close()
                    raise
                delay = gen.send(None)
        except StopIteration as e:
            return e.value
        finally:
            ep.ended = _monotonic()
            io.release()
    finally:
        if turn is not None:
            _pass_turn(core, turn)


async def _follow(io: Any, f: Follower) -> None:
    """(run_async.) A follower's wait (see the core's docstring): on a future of this loop,
    ``io`` released meanwhile (its future set before: a wake-up, which holds io, is not
    lost)."""
    loop = asyncio.get_running_loop()
    fut = f.fut = loop.create_future()
    f.loop = loop
    timer = loop.call_later(f.delay, wake_future, fut)
    io.release()
    try:
        await fut
    finally:
        timer.cancel()
        io.retake()


async def _take_turn(core: Core, gen: Wait, collective: str, timeout: float | None
                     ) -> tuple[int, asyncio.AbstractEventLoop] | None:
    """(run_async, a collective.) This loop's turn, waited for behind the collectives of
    this loop that started before; None where another thread or loop holds the turn (the
    call is then refused by the group, which is busy)."""
    turn = (_get_ident(), asyncio.get_running_loop())
    held = core._turn.setdefault(0, turn)
    if held is not turn and held[1].is_closed():
        # (left by a call of a loop closed before it could end: nothing can pass it;
        # where a call queued there gave up, the group breaks, as _pass_turn would)
        if core._owed or any(f.done() for f in core._turns):
            core.abort(core._owed or f"a collective on group {core.name!r} queued on "
                       f"rank {core.rank} gave up before it began (its loop closed)")
        core._turns.clear()
        core._owed = ""
        core._turn[0] = held = turn
    if held is turn:
        return turn
    if held != turn:
        return None  # (another thread's or loop's turn: refused as before)
    try:
        await _queue_turn(core, collective, timeout, turn)
    except BaseException:
        gen.close()
        raise
    return turn


async def _give_the_loop_a_turn(core: Core, collective: str) -> None:
    """(run_async: see there.) A turn of the event loop before the call starts."""
    ep = core.ep
    ep.yielding += 1
    try:
        await asyncio.sleep(0)  # (gen not started: nothing to close if cancelled here)
    except BaseException:
        cancelled_before_it_began(core, collective)
        raise
    finally:
        ep.yielding -= 1


DRIVER_CODES.add(run_async.__code__)
