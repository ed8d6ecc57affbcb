"""How long a rank's process takes to exit after it closes its group: each rank its own process.

``python benchmarks/exit_after_close.py N TRANSPORT HOW [REPEAT]``: N ranks over TRANSPORT
("tcp" or "zmq") run 50 barriers, then
- ``close``: every rank closes at once;
- ``abort``: rank 1 aborts, the others find out in a barrier and close; rank 1 closes 0.5 s
  later;
- ``unclosed``: every rank leaves its group unclosed (vLLM's API has no close()).
Prints, per rank, the seconds from its close() (or its last call) to its process's exit.
ZeroMQ before b6195d4 held the exit of ranks 1-3 of ``4 zmq close`` for LINGER_MS, 5 s.
"""

import subprocess
import sys
import time


def rank_main(rank: int, n: int, port: int, transport: str, how: str) -> None:
    import ctrlcomm

    g = ctrlcomm.Group.create("127.0.0.1", port, rank, n, name="exit", transport=transport,
                              timeout=20)
    for _ in range(50):
        g.barrier()
    if how == "abort":
        if rank == 1:
            g.abort("rank 1 gives up")
            time.sleep(0.5)
        else:
            try:
                g.barrier()
            except ctrlcomm.PeerLostError:
                pass
    t = time.time()
    if how != "unclosed":
        g.close()
    print(f"{t:.4f}", flush=True)


def main(n: int, transport: str, how: str, repeat: int) -> None:
    from ctrlcomm.testing import free_port

    for _ in range(repeat):
        port = free_port()
        ps = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), str(n), str(port),
                                transport, how], stdout=subprocess.PIPE, text=True)
              for r in range(n)]
        ends: list[float | None] = [None] * n
        start = time.time()
        while None in ends and time.time() - start < 60:
            for i, p in enumerate(ps):
                if ends[i] is None and p.poll() is not None:
                    ends[i] = time.time()
            time.sleep(0.005)
        took = []
        for p, end in zip(ps, ends, strict=True):
            if end is None:
                p.kill()
            out = p.communicate()[0].strip()
            took.append(f"{end - float(out):.2f} s" if out and end is not None else "failed")
        print(f"{n} ranks, {transport}, {how}: exit after close, per rank: {', '.join(took)}")


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
    else:
        main(int(sys.argv[1]), sys.argv[2], sys.argv[3],
             int(sys.argv[4]) if len(sys.argv) > 4 else 3)
