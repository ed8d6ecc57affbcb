"""One rank of a multi-host scenario, run inside a network namespace by the tests.

Prints one JSON line: what happened and when. Usage:
    netns_rank.py STORE_HOST STORE_PORT RANK WORLD ITERS LIVENESS [PAYLOAD_BYTES]
"""

import json
import sys
import time

import ctrlcomm


def main() -> None:
    host, port, rank, world, iters, liveness = sys.argv[1:7]
    payload = int(sys.argv[7]) if len(sys.argv) > 7 else 0
    rank, world, iters = int(rank), int(world), int(iters)
    g = ctrlcomm.Group.create(host, int(port), rank, world, host_store=False, timeout=60,
                              liveness_timeout=float(liveness), heartbeat_interval=0.5)
    print(json.dumps({"event": "formed", "t": time.time()}), flush=True)
    done = 0
    t0 = time.monotonic()
    try:
        for i in range(iters):
            obj = (i, rank) if not payload else bytes(payload)
            got = g.all_reduce((i, 1)) if not payload else g.broadcast(obj, src=0)
            if not payload and got != (i * world, world):
                raise AssertionError(f"wrong result {got} at {i}")
            done += 1
            time.sleep(0.01)
        print(json.dumps({"event": "ok", "done": done, "elapsed": time.monotonic() - t0}),
              flush=True)
    except ctrlcomm.CtrlcommError as e:
        print(json.dumps({"event": "error", "type": type(e).__name__, "msg": str(e),
                          "ranks": getattr(e, "ranks", []), "done": done,
                          "at": time.time()}), flush=True)
    g.close()


if __name__ == "__main__":
    main()
