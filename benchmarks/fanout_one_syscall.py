"""A root's fan-out: one send() per rank on Unix stream sockets, or one sendmmsg() for all.

The question (benchmarks/README.md, 2026-12-04): at world 8 on two CPUs, a broadcast's root
is preempted during its fan-out in a quarter of the calls (each woken rank runs on the
root's CPU before the root has sent to the next). With every send in one system call, the
root would be preempted at most once, after the last. No ctrlcomm here, no deadlines, MAC
or codec: forked ranks, rank 0 sends 64 bytes to each (the broadcast), each answers one byte
(a star barrier's arrival) and waits for the root's one-byte release, as the bench's rooted
ops run. Prints, per fan-out, the median of each iteration's slowest rank's time of the
broadcast, its p90, the root's own median and in how many iterations the root was switched
out involuntarily. ``python benchmarks/fanout_one_syscall.py 8 1500 stream mmsg stream mmsg``
(Linux only: abstract Unix datagram addresses, glibc's sendmmsg through ctypes.)
"""

import ctypes
import ctypes.util
import os
import resource
import select
import socket
import statistics
import sys
import tempfile
import time

libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
WARMUP = 50


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class MsgHdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32),
                ("iov", ctypes.POINTER(IoVec)), ("iovlen", ctypes.c_size_t),
                ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]


class MMsgHdr(ctypes.Structure):
    _fields_ = [("hdr", MsgHdr), ("len", ctypes.c_uint)]


class OneCallFanOut:
    """One datagram to each of ``dests`` (abstract Unix addresses) in one sendmmsg()."""

    def __init__(self, sock: socket.socket, dests: list[bytes]) -> None:
        self.fd, self.n = sock.fileno(), len(dests)
        family = socket.AF_UNIX.to_bytes(2, sys.byteorder)
        self.names = [ctypes.create_string_buffer(family + a, 2 + len(a)) for a in dests]
        self.iov = IoVec()
        self.msgs = (MMsgHdr * self.n)()
        for m, name, a in zip(self.msgs, self.names, dests, strict=True):
            m.hdr.name, m.hdr.namelen = ctypes.addressof(name), 2 + len(a)
            m.hdr.iov, m.hdr.iovlen = ctypes.pointer(self.iov), 1

    def send(self, data: bytes) -> None:
        buf = ctypes.c_char_p(data)
        self.iov.base, self.iov.len = ctypes.cast(buf, ctypes.c_void_p).value, len(data)
        if libc.sendmmsg(self.fd, self.msgs, self.n, 0) != self.n:
            raise OSError(ctypes.get_errno(), "sendmmsg sent fewer than asked")


def run(mode: str, n: int, iters: int, out_dir: str) -> None:
    tag = os.getpid()
    addr = [b"\0fanout-%d-%d" % (tag, r) for r in range(n)]
    pairs = [socket.socketpair() for _ in range(n)]  # [r]: root's end 0, rank r's end 1
    dgram = [socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(n)]
    for r in range(n):
        dgram[r].bind(addr[r])
    kids = []
    for r in range(1, n):
        pid = os.fork()
        if pid == 0:
            s, d = pairs[r][1], dgram[r]
            ts = []
            for _ in range(iters):
                t0 = time.perf_counter()
                if mode == "mmsg":
                    d.recv(256)
                else:
                    s.recv(64, socket.MSG_WAITALL)
                ts.append(time.perf_counter() - t0)
                s.send(b"a")
                (d if mode == "mmsg" else s).recv(1)
            with open(os.path.join(out_dir, f"{r}.txt"), "w") as f:
                f.write(" ".join(map(repr, ts)))
            os._exit(0)
        kids.append(pid)
    streams = [pairs[r][0] for r in range(1, n)]
    ep = select.epoll()
    for s in streams:
        ep.register(s.fileno(), select.EPOLLIN)
    fan = OneCallFanOut(dgram[0], addr[1:])

    def fan_out(data: bytes) -> None:
        if mode == "mmsg":
            fan.send(data)
        else:
            for s in streams:
                s.send(data)

    msg = b"x" * 64
    ts, switched = [], []
    time.sleep(0.2)  # every rank is waiting
    for _ in range(iters):
        c0 = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw
        t0 = time.perf_counter()
        fan_out(msg)
        ts.append(time.perf_counter() - t0)
        switched.append(resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw - c0)
        got = 0
        while got < n - 1:
            for fd, _ in ep.poll():
                os.read(fd, 1)
                got += 1
        fan_out(b"r")
    for p in kids:
        os.waitpid(p, 0)
    times = [ts]
    for r in range(1, n):
        with open(os.path.join(out_dir, f"{r}.txt")) as f:
            times.append([float(x) for x in f.read().split()])
    slow = sorted(max(t[i] for t in times) for i in range(WARMUP, iters))
    print(f"{mode}: slowest rank median {statistics.median(slow) * 1e6:.0f} us, "
          f"p90 {slow[int(0.9 * len(slow))] * 1e6:.0f}; root median "
          f"{statistics.median(ts[WARMUP:]) * 1e6:.0f} us, switched out in "
          f"{sum(1 for x in switched[WARMUP:] if x)} of {iters - WARMUP}", flush=True)
    for s in (*(p for pair in pairs for p in pair), *dgram):
        s.close()


if __name__ == "__main__":
    n, iters = int(sys.argv[1]), int(sys.argv[2])
    with tempfile.TemporaryDirectory() as d:
        for m in sys.argv[3:] or ["stream", "mmsg"]:
            if m not in ("stream", "mmsg"):
                sys.exit(f"{m!r}: the fan-outs are 'stream' and 'mmsg'")
            run(m, n, max(iters, WARMUP + 10), d)
