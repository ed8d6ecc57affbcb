"""The blocking driver: run a call's generator in this thread, holding the endpoint's ``io``
while it runs, sleeping in the kernel whenever it waits (the endpoint's ``wait``, or a
follower's own event: see the core's docstring)."""

from __future__ import annotations

import threading
from typing import Any

from ._core import DRIVER_CODES, Core, Follower, Wait


def run_sync(core: Core, gen: Wait, collective: str = "") -> Any:
    """Blocking driver: run ``gen`` in this thread, sleeping in the kernel when it waits.
    ``collective``: its name, where it is one: refused at once where another is in progress
    in another thread (not after waiting for that thread's step to let the sockets go)."""
    ep = core.ep
    io = ep.io
    # (io's methods, in line for the usual case: the lock free, no coroutine waiting for it)
    lock, waiters = io._lock, io.waiters
    if not lock.acquire(False):
        if collective and core._owner:
            gen.close()
            core.enter_collective(collective)  # (raises)
        io.acquire()
    try:
        delay = next(gen)
        while True:
            try:
                if type(delay) is Follower:
                    # (its event set before io goes: a wake-up, which holds io, is not lost)
                    ev = delay.event = threading.Event()
                    io.release()
                    try:
                        ev.wait(delay.delay)
                    finally:
                        io.retake()
                else:
                    lock.release()
                    if waiters:
                        io.wake_waiters()
                    try:
                        ep.wait(delay)
                    finally:
                        if not lock.acquire(False):
                            io.retake()
            except BaseException as e:  # Ctrl-C while it slept: the call sees it where it
                # waits, so it ends now (the lead released, the others told), not when the
                # exception's traceback, which holds the generator, goes
                delay = gen.throw(e)
                continue
            delay = gen.send(None)
    except StopIteration as e:
        return e.value
    finally:
        lock.release()
        if waiters:
            io.wake_waiters()


DRIVER_CODES.add(run_sync.__code__)
