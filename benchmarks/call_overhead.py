"""Python cost of one call on a rank when nothing has to wait: no sockets, no other process.

A group's core is given an in-memory endpoint that answers at once (for a non-root rank of a
star at world 4: the root's reply is queued when the rank sends), so a call runs its whole
path (argument checks, plan, framing, mailbox, decoding) without a system call. What it
prints is the floor of a call's CPU on this interpreter, warm; in a real run each call also
pays its system calls and the caches a context switch leaves cold (about three times this,
measured on the reference machine). ``python benchmarks/call_overhead.py [op ...]``
"""

import sys
import time

from ctrlcomm import _wire as w
from ctrlcomm._core import Core
from ctrlcomm._group import Group
from ctrlcomm.testing._standin import StandInEndpoint


class AnsweringEndpoint(StandInEndpoint):
    """Stands in for the root: every message sent gets the same payload back from rank 0."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[w.Message] = []

    def _answer(self, header: tuple, payload: bytes) -> None:
        op, seq, rnd = header[3], header[8], header[9]
        self.pending.append(w.Message(w.COLL, 0, 1, seq, rnd, op, w.NO_ROOT, w.PICKLE, payload))

    def send_framed(self, dsts, data: list[bytes]) -> None:
        at = w.stream_prefix_lens([w.HEADER.size, 0, w.MAC_SIZE]).__len__()  # (the usual's)
        one = data[0]
        self._answer(w.HEADER.unpack_from(one, at), one[at + w.HEADER.size:-w.MAC_SIZE])

    def send_many(self, dsts, frames) -> None:
        self._answer(w.HEADER.unpack(frames[0]), frames[1])

    def drain(self, sink) -> int:
        got, self.pending = self.pending, []
        for m in got:
            sink(m)
        return len(got)


def answered_group() -> Group:
    """Rank 1 of a world-4 group whose endpoint answers at once (for the tests too)."""
    core = Core(name="bench", rank=1, size=4, group_id=1, endpoint=AnsweringEndpoint(),
                codec=w.PICKLE, key=b"k" * 32, timeout=10.0)
    g = Group.__new__(Group)
    g._core = core
    return g


def main() -> None:
    ops = sys.argv[1:] or ["barrier", "all_reduce", "all_gather"]
    g = answered_group()
    calls = {"barrier": lambda: g.barrier(),
             "all_reduce": lambda: g.all_reduce([1, 2], op="max"),
             "all_gather": lambda: g.all_gather({"rank": 1})}
    for op in ops:
        f = calls[op]
        for _ in range(20000):
            f()
        n = 200000
        t0 = time.process_time()
        for _ in range(n):
            f()
        us = 1e6 * (time.process_time() - t0) / n
        print(f"{op:10s} {us:6.2f} us of CPU per call (non-root rank of a world-4 star, warm)")


if __name__ == "__main__":
    main()
