"""Where a woken process runs on this machine, and how soon: no ctrlcomm, two processes.

Process A writes a byte to a pipe every 2 ms, then keeps its CPU busy for SPIN us; process B
sleeps in read() on that pipe. For each wake-up: the CPU A wrote from, the CPU B woke on, and
B's wake-up latency (A's write to B's return from read). On a machine that spreads work, B
wakes on the other, idle CPU; where the kernel packs woken tasks onto busy CPUs, B wakes on
A's CPU and preempts it (what the root of a world-8 broadcast meets: benchmarks/README.md).
``python benchmarks/wake_placement.py [SPIN_US ...]`` (default 0 200). Linux only.
"""

import ctypes
import os
import statistics
import struct
import sys
import time

N = 400
REC = struct.Struct("<di")


def run(spin_us: float) -> str:
    libc = ctypes.CDLL(None)
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:  # B
        out = []
        for _ in range(N):
            os.read(r1, 8)
            out.append(REC.pack(time.perf_counter(), libc.sched_getcpu()))
        os.write(w2, b"".join(out))
        os._exit(0)
    sent = []
    for _ in range(N):
        time.sleep(0.002)
        cpu = libc.sched_getcpu()
        t = time.perf_counter()
        os.write(w1, b"x")
        sent.append((t, cpu))
        while time.perf_counter() - t < spin_us * 1e-6:
            pass
    got = b""
    while len(got) < N * REC.size:
        got += os.read(r2, N * REC.size)
    os.waitpid(pid, 0)
    for fd in (r1, w1, r2, w2):
        os.close(fd)
    woke = [REC.unpack_from(got, i * REC.size) for i in range(N)]
    same = [(b[0] - a[0]) * 1e6 for a, b in zip(sent, woke, strict=True) if a[1] == b[1]]
    other = [(b[0] - a[0]) * 1e6 for a, b in zip(sent, woke, strict=True) if a[1] != b[1]]

    def med(v: list[float]) -> str:
        return f"{statistics.median(v):.0f} us" if v else "-"

    return (f"A spins {spin_us:.0f} us after its write: B woke on A's CPU {len(same)} of {N} "
            f"times (median latency {med(same)}), on another {len(other)} (median {med(other)})")


if __name__ == "__main__":
    print(f"CPUs: {os.cpu_count()}")
    for arg in sys.argv[1:] or ["0", "200"]:
        print(run(float(arg)))
