"""One rank of the mpi4py baseline (run under MPICH's mpiexec by ``ctrlcomm bench``)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from ._measure import _measure_sync, op_sizes


def main() -> None:
    import numpy as np
    from mpi4py import MPI

    cfg_path, out_dir = sys.argv[1], sys.argv[2]
    with open(cfg_path) as f:
        cfg = json.load(f)
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()

    def all_reduce(obj: Any) -> Any:
        a = np.array(obj, dtype=np.int64) if isinstance(obj, tuple) else obj
        out = np.empty_like(a)
        comm.Allreduce(a, out, op=MPI.SUM)
        return out

    def send_recv(obj: Any) -> Any:
        if n == 1:
            return None
        if rank == 0:
            comm.send(obj, dest=1)
            return comm.recv(source=1)
        if rank == 1:
            comm.send(comm.recv(source=0), dest=0)
        return None

    calls = {
        "barrier": lambda obj: comm.barrier(),
        "all_reduce": all_reduce,
        "broadcast": lambda obj: comm.bcast(obj, root=0),
        "all_gather": lambda obj: comm.allgather(obj),
        "gather": lambda obj: comm.gather(obj, root=0),
        "scatter": lambda obj: comm.scatter([obj] * n if rank == 0 else None, root=0),
        "all_to_all": lambda obj: comm.alltoall([obj] * n),
        "send_recv": send_recv,
    }
    plan = op_sizes(cfg["ops"], cfg["sizes"])
    res = _measure_sync(calls, comm.barrier, plan, rank, cfg["iters"], cfg["warmup"],
                        lambda op, size: None)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump([[op, size, v] for (op, size), v in res.items()], f)


if __name__ == "__main__":
    main()
