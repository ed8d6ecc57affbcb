"""vLLM's ``StatelessProcessGroup`` from ctrlcomm: the same calls as
``vllm.distributed.utils.StatelessProcessGroup`` (create, broadcast_obj, all_gather_obj,
barrier, send_obj/recv_obj), over direct sockets instead of a TCPStore. vLLM need not be
installed.

Run with 3 ranks (any number from 2 works):

    ctrlcomm run -n 3 -- python examples/vllm_dropin.py

Code that cannot change its import (it names vLLM's class) gets this group under vLLM's
name with ``import ctrlcomm.vllm; ctrlcomm.vllm.install()`` on every rank.
"""

import os

from ctrlcomm import StatelessProcessGroup  # was: from vllm.distributed.utils import ...

# vLLM's callers pass these explicitly; here they come from what `ctrlcomm run` sets.
env = os.environ
pg = StatelessProcessGroup.create(host=env["CTRLCOMM_HOST"], port=int(env["CTRLCOMM_PORT"]),
                                  rank=int(env["CTRLCOMM_RANK"]),
                                  world_size=int(env["CTRLCOMM_WORLD_SIZE"]),
                                  store_timeout=30)  # (also every call's default deadline)
rank, n = pg.rank, pg.world_size

# What vLLM broadcasts at start-up: an NCCL unique id (here a stand-in of the same size).
uid = pg.broadcast_obj(bytes(range(128)) if rank == 0 else None, src=0)
assert uid == bytes(range(128))
print(f"broadcast_obj {len(uid)} bytes")

shapes = pg.all_gather_obj((rank + 1, 4096))
assert shapes == [(r + 1, 4096) for r in range(n)]
print(f"all_gather_obj {shapes}")

# Unlike the original's store keys, two ranks sending to one destination never overwrite
# each other: rank 0 receives from every other rank.
if rank:
    pg.send_obj({"kv_blocks": 10 * rank}, dst=0)
else:
    got = [pg.recv_obj(src=r) for r in range(1, n)]
    assert got == [{"kv_blocks": 10 * r} for r in range(1, n)]
    print(f"recv_obj {got}")

pg.barrier(timeout=30.0)
pg.close()  # (vLLM's class has no close(); ctrlcomm's does, and closes at exit anyway)
print("done")
