"""An in-memory network that runs the plans of every rank, in a random delivery order."""

from __future__ import annotations

import pickle
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._plans import Ctx, Plan, Step


class DeadlockError(AssertionError):
    """No rank can progress and no message is in flight, yet some rank has not finished."""


@dataclass
class SimResult:
    results: list[Any]
    sends: list[int]  # messages each rank sent
    steps: list[int]  # steps each rank waited on (a bound on its hops)
    trace: list[str] = field(default_factory=list)


def simulate(make_plan: Callable[[Ctx], Plan], world_size: int, *, seed: int | None = 0,
             copy: bool = True) -> SimResult:
    """Run ``make_plan(ctx)`` for ranks ``0..world_size-1`` over a simulated network.

    At each turn one action is picked at random: deliver one in-flight message (any of them,
    not first-in first-out), or resume a rank whose current step has all its messages.
    Payloads are copied through pickle, as on a real network. Raises :class:`DeadlockError`
    on deadlock and ``AssertionError`` on a message that is duplicated or never received.
    """
    rng = random.Random(seed)
    n = world_size
    gens = [make_plan(Ctx(r, n)) for r in range(n)]
    step: list[Step | None] = [None] * n
    done = [False] * n
    results: list[Any] = [None] * n
    inbox: list[dict[tuple[int, int], Any]] = [{} for _ in range(n)]
    net: list[tuple[int, int, int, Any]] = []  # (src, dst, round, payload)
    sends = [0] * n
    steps = [0] * n

    def advance(r: int, reply: dict[int, Any] | None) -> None:
        while True:
            try:
                st = gens[r].send(reply)  # type: ignore[arg-type]
            except StopIteration as e:
                done[r] = True
                results[r] = e.value
                step[r] = None
                return
            for dst, obj in st.sends:
                assert 0 <= dst < n and dst != r, f"rank {r} sends to bad rank {dst}"
                net.append((r, dst, st.round, pickle.loads(pickle.dumps(obj)) if copy else obj))
                sends[r] += 1
            if st.recvs:
                assert len(set(st.recvs)) == len(st.recvs), f"rank {r} receives twice from one rank"
                steps[r] += 1
                step[r] = st
                return
            reply = {}

    def ready(r: int) -> bool:
        st = step[r]
        return st is not None and all((st.round, s) in inbox[r] for s in st.recvs)

    for r in range(n):
        advance(r, None)
    while not all(done):
        runnable = [r for r in range(n) if not done[r] and ready(r)]
        choices = len(net) + len(runnable)
        if choices == 0:
            waiting = {r: step[r].recvs for r in range(n) if not done[r]}  # type: ignore[union-attr]
            raise DeadlockError(f"deadlock in a world of {n}: waiting {waiting}")
        i = rng.randrange(choices)
        if i < len(net):
            src, dst, rnd, obj = net.pop(i)
            key = (rnd, src)
            assert key not in inbox[dst], f"rank {dst} got two messages from {src} in round {rnd}"
            inbox[dst][key] = obj
        else:
            r = runnable[i - len(net)]
            st = step[r]
            assert st is not None
            reply = {s: inbox[r].pop((st.round, s)) for s in st.recvs}
            advance(r, reply)
    stray = [(d, k) for d in range(n) for k in inbox[d]] + [(m[1], (m[2], m[0])) for m in net]
    assert not stray, f"messages sent but never received: {stray}"
    return SimResult(results, sends, steps)
