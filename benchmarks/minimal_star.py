"""A minimal Python star all_reduce over abstract Unix sockets: what Python alone costs.

No deadlines, liveness, mismatch checks, MAC or codec choice: ranks are forked processes,
rank 0 gathers the others' pickled lists, combines them and sends the result back. Prints each
rank's wall time and user/system CPU per op. A floor to hold ctrlcomm's per-op overhead against
(benchmarks/README.md): ``python benchmarks/minimal_star.py 4``. Linux only.
"""

import os
import pickle
import select
import socket
import struct
import sys
import time

ITERS = 5000
LEN = struct.Struct("<I")


def rank_main(r: int, n: int, names: list[str]) -> None:
    ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ls.bind(names[r])
    ls.listen(16)
    time.sleep(0.3)  # every rank listens before anyone connects
    out = {}
    for p in range(1, n) if r == 0 else (0,):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(names[p])
        out[p] = s
    ins = [ls.accept()[0] for _ in range(n - 1 if r == 0 else 1)]
    ep = select.epoll()
    for c in ins:
        c.setblocking(False)
        ep.register(c.fileno(), select.EPOLLIN)
    by_fd = {c.fileno(): c for c in ins}
    view = memoryview(bytearray(65536))

    def receive() -> list[list[int]]:
        msgs = []
        for fd, _ in ep.poll(1.0):
            got = by_fd[fd].recv_into(view)
            pos = 0
            while pos < got:
                (ln,) = LEN.unpack_from(view, pos)
                msgs.append(pickle.loads(view[pos + 4 : pos + 4 + ln]))
                pos += 4 + ln
        return msgs

    def send(s: socket.socket, obj: list[int]) -> None:
        data = pickle.dumps(obj, 5)
        s.sendmsg([LEN.pack(len(data)) + data])

    def all_reduce(v: list[int]) -> list[int]:
        if r == 0:
            acc, got = list(v), 0
            while got < n - 1:
                for m in receive():
                    acc = [max(a, b) for a, b in zip(acc, m, strict=True)]
                    got += 1
            for p in range(1, n):
                send(out[p], acc)
            return acc
        send(out[0], v)
        while True:
            m = receive()
            if m:
                return m[0]

    for _ in range(300):
        all_reduce([1, 2])
    t0, c0 = time.perf_counter(), os.times()
    for _ in range(ITERS):
        all_reduce([1, 2])
    t1, c1 = time.perf_counter(), os.times()
    print(f"rank {r}: {1e6 * (t1 - t0) / ITERS:.0f} us per op, user "
          f"{1e6 * (c1.user - c0.user) / ITERS:.0f} us, system "
          f"{1e6 * (c1.system - c0.system) / ITERS:.0f} us", flush=True)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    names = [f"\0minimal-star-{os.getpid()}-{r}" for r in range(n)]
    pids = []
    for r in range(n):
        pid = os.fork()
        if pid == 0:
            try:
                rank_main(r, n, names)
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
