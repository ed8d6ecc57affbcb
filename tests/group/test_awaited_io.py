"""An awaited call that finds the group's sockets held by another thread, while the group
itself is free (a watchdog's abort sending, a reader callback of another loop), waits for
them in its event loop: other tasks run meanwhile, and the call goes on at their release."""

import asyncio
import threading
import time

import ctrlcomm
from ctrlcomm.testing import free_port


def test_an_awaited_call_waits_for_the_sockets_without_blocking_its_loop():
    with ctrlcomm.Group.create("127.0.0.1", free_port(), 0, 1, name="io", timeout=10) as g:
        io = g._core.ep.io  # (what a watchdog's abort holds while it sends: see Core)
        held, release = threading.Event(), threading.Event()

        def holder():
            with io:
                held.set()
                release.wait(10)

        t = threading.Thread(target=holder)
        t.start()
        held.wait(5)

        async def main():
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            tick = asyncio.create_task(ticker())
            loop = asyncio.get_running_loop()
            loop.call_later(0.3, release.set)
            t0 = time.monotonic()
            got = await g.aio.all_reduce(5)
            waited = time.monotonic() - t0
            tick.cancel()
            return got, waited, ticks

        got, waited, ticks = asyncio.run(main())
        t.join(5)
        assert got == 5
        assert 0.25 <= waited < 1.0, waited  # (went on at the release, not at IO_TAKE_S)
        assert ticks >= 10, ticks  # the loop ran the other task meanwhile


def test_an_awaited_call_gives_up_on_sockets_held_past_its_wait():
    """(A copy held at a fork, say: the call is refused after IO_TAKE_S, and the group
    stays usable once they are free.)"""
    with ctrlcomm.Group.create("127.0.0.1", free_port(), 0, 1, name="io2", timeout=10) as g:
        io = g._core.ep.io
        done = threading.Event()

        def holder():
            with io:
                done.wait(10)

        t = threading.Thread(target=holder)
        t.start()
        time.sleep(0.05)
        try:
            async def call():
                return await g.aio.barrier()

            try:
                asyncio.run(call())
                raised = None
            except ctrlcomm.ConcurrentUseError as e:
                raised = e
        finally:
            done.set()
            t.join(5)
        assert raised is not None and "busy" in str(raised)
        assert g.all_reduce(2) == 2
