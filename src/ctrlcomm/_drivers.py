"""The blocking driver: run a call's generator in this thread, sleeping in the kernel whenever
it waits (the endpoint's ``wait``)."""

from __future__ import annotations

from typing import Any

from ._core import DRIVER_CODES, Core, Wait


def run_sync(core: Core, gen: Wait) -> Any:
    """Blocking driver: run ``gen`` in this thread, sleeping in ``zmq_poll`` when it waits."""
    try:
        delay = next(gen)
        while True:
            try:
                core.ep.wait(delay)
            except BaseException as e:  # Ctrl-C while it slept: the call sees it where it
                # waits, so it ends now (the lock released, the others told), not when the
                # exception's traceback, which holds the generator, goes
                delay = gen.throw(e)
                continue
            delay = gen.send(None)
    except StopIteration as e:
        return e.value


DRIVER_CODES.add(run_sync.__code__)
