"""One rank of a group spread over two namespaced hosts, two ranks each, run by the tests:
prints one JSON line with its results and the peers it sends to through shared memory.
Usage: shm_rank.py STORE_HOST STORE_PORT RANK WORLD"""

import json
import sys

import ctrlcomm


def main() -> None:
    host, port, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    with ctrlcomm.Group.create(host, port, rank, world, host_store=False, timeout=60) as g:
        out = {"gather": g.all_gather(rank), "sum": g.all_reduce(rank),
               "a2a": g.all_to_all([rank * 10 + d for d in range(world)]),
               "bcast": len(g.broadcast(bytes(3 << 20) if rank == 0 else None, src=0))}
        g.send(rank, dst=(rank + 1) % world)
        out["p2p"] = g.recv(src=(rank - 1) % world)
        out["rings"] = sorted(r for r, c in g._core.ep.out.items() if c.ring is not None)
        out["kind"] = g.stats()["transport"]
        g.barrier()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
