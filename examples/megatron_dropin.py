"""Megatron's ``AsyncZMQCommunicator`` from ctrlcomm, over a torch gloo process group, used
as Megatron's dynamic inference engine uses it: every step, the ranks of an expert-parallel
group agree by an awaited ``all_reduce_max`` whether any of them has work (a rank without
work must still run a dummy step, or its peers' expert all-to-all would hang), and stop
together once none has. Needs torch (``pip install 'ctrlcomm[torch]'``).

Run with 4 ranks (two expert-parallel groups of 2):

    ctrlcomm run -n 4 -- python examples/megatron_dropin.py
"""

import asyncio
import os

import torch.distributed as dist
import zmq

from ctrlcomm import AsyncZMQCommunicator  # was: from megatron.core.inference...

EP = 2

# Nothing else listens on the port `ctrlcomm run` picked here, so torch's store takes it
# (the communicator's own store listens on a free port of the group's first rank).
host, port = os.environ["CTRLCOMM_HOST"], os.environ["CTRLCOMM_PORT"]
dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}",
                        rank=int(os.environ["CTRLCOMM_RANK"]),
                        world_size=int(os.environ["CTRLCOMM_WORLD_SIZE"]))
rank = dist.get_rank()
ep_group, _ = dist.new_subgroups(EP)  # ranks [0, 1] and [2, 3]
ep_first = rank - rank % EP

ctx = zmq.Context()
comm = AsyncZMQCommunicator(ctx, ep_group, hostname=host, timeout=30)

# From plain code (setup), the blocking form: the longest prompt in the group.
longest = comm.sync_all_reduce_max(100 + rank)
assert longest == 100 + ep_first + EP - 1
print(f"sync_all_reduce_max {longest}")


async def engine_loop() -> tuple[int, int]:
    pending = rank + 1  # requests this rank still has; ranks run dry at different steps
    steps = dummy = 0
    while True:
        # One message carries both values; the loop keeps serving other tasks meanwhile.
        any_work, most_pending = await comm.all_reduce_max(int(pending > 0), pending)
        assert any_work == int(most_pending > 0)
        if not any_work:
            return steps, dummy
        if pending:
            pending -= 1
        else:
            dummy += 1
        steps += 1
        await asyncio.sleep(0)


steps, dummy = asyncio.run(engine_loop())
# (every rank of a group steps as often as its busiest rank has requests)
assert steps == ep_first + EP, steps
assert dummy == steps - (rank + 1), dummy
print(f"engine loop: {steps} steps, {dummy} dummy")


async def tail() -> tuple[int, int]:
    # async_op=False blocks until done, then yields to the loop once, as Megatron's does.
    most = await comm.all_reduce_max(rank, async_op=False)
    tokens = await comm.all_reduce_sum(10 * rank, timeout=5.0)
    return most, tokens


most, tokens = asyncio.run(tail())
assert most == ep_first + EP - 1
assert tokens == sum(10 * r for r in range(ep_first, ep_first + EP))
print(f"all_reduce_max(async_op=False) {most} all_reduce_sum {tokens}")

comm.close()
ctx.term()  # (Megatron's shutdown: returns at once after close())
dist.destroy_process_group()
print("done")
