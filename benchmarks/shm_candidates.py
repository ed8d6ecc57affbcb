"""Candidates for a same-host shared-memory transport, measured: a 64-byte ping-pong between two processes.

Each candidate carries a 64-byte message from process A to process B and back, N times (after
WARMUP round trips), both processes forked for the run. For each candidate and wake-up mode it
reports A's median and p99 round trip, and the CPU time (user + system, ``time.process_time()``
in each process) of both processes together per round trip: a transport that spins is fast but
burns a core, and this machine has two.

The candidates (each skipped, with a message, where its package is missing):

- ``socketpair``: ``socket.socketpair()`` (AF_UNIX stream), the baseline: a plain kernel socket.
- ``stdlib-eventfd``: ``multiprocessing.shared_memory.SharedMemory`` holding two
  single-producer single-consumer rings (head/tail counters plus slots), ``os.eventfd`` to wake
  the reader, who sleeps in ``poll`` on the eventfd.
- ``posix_ipc-mq``: a POSIX message queue each way (``posix_ipc.MessageQueue``); on Linux its
  descriptor is a file descriptor.
- ``posix_ipc-sem``: the rings above, a named POSIX semaphore each way to wake the reader.
- ``faster-fifo``: ``faster_fifo.Queue`` each way (a ring and a process-shared mutex and condition
  variable in shared memory), raw bytes (no pickling).
- ``iceoryx2``: a publish-subscribe service each way for the data plus an event service each way
  (``Notifier.notify`` / ``Listener.blocking_wait``) to wake the reader.

The wake-up modes: ``block``: the reader sleeps in the kernel until woken (no spinning);
``spin``: the reader polls without sleeping for up to SPIN_US, then sleeps as in ``block``.
For the eventfd rings the writer writes the eventfd after every message in these two modes;
``spin-flag``: the reader marks itself asleep in shared memory before it sleeps, and the writer
writes the eventfd only then (a 1 ms poll timeout backs up a lost wake-up: Python has no memory
fence; the number of time-outs that found a message waiting is reported). ``fd`` (message
queue): the reader waits in ``poll`` on the queue's descriptor, then reads without blocking, as
``loop.add_reader`` would.

Every (candidate, mode) runs in turn, and the whole set ROUNDS times, in alternating order
(reversed every other round); the table gives the median over the rounds of each figure.

``python benchmarks/shm_candidates.py [N] [ROUNDS] [CANDIDATE,...]`` (defaults 20000, 3, all).
Linux only (eventfd, fork). The candidates' packages: ``pip install iceoryx2 faster-fifo posix_ipc``.
"""

import gc
import importlib.metadata
import multiprocessing as mp
import os
import platform
import select
import socket
import statistics
import sys
import time
from multiprocessing import shared_memory

MSG_SIZE = 64
WARMUP = 1000
SPIN_US = 50
BACKSTOP_MS = 1  # spin-flag: the longest a lost wake-up can cost
RING_SLOTS = 16  # a ping-pong has one message in flight; a few more cost nothing


def _spin(poll, spin_ns):
    """Calls poll() until it returns something other than None, for at most spin_ns."""
    deadline = time.perf_counter_ns() + spin_ns
    while True:
        got = poll()
        if got is not None:
            return got
        if time.perf_counter_ns() >= deadline:
            return None


class Endpoint:
    """One process's end of a two-way channel, set up for one wake-up mode."""

    spin_ns = 0

    def send(self, msg: bytes) -> None:
        raise NotImplementedError

    def recv(self) -> bytes:
        raise NotImplementedError

    def _try(self) -> bytes | None:
        """A message if one is there, without waiting (the ends that spin on it)."""
        raise NotImplementedError

    def _spun(self) -> bytes | None:
        """In the spin mode, a message that came within SPIN_US of polling; else None."""
        return _spin(self._try, self.spin_ns) if self.spin_ns else None

    def stats(self) -> dict:
        """Counters worth reporting (per process), beside the timings."""
        return {}

    def close(self) -> None:
        pass


class Candidate:
    """A way to carry the messages: what it needs, its modes, how each process opens its end."""

    name = ""
    dist: str | None = None  # the PyPI distribution it needs (None: the standard library)
    module: str | None = None
    modes: tuple[str, ...] = ("block", "spin")
    fd_wait = ""  # can the reader wait on a file descriptor (asyncio's add_reader)?

    def missing(self) -> str | None:
        """Why this candidate cannot run here, or None."""
        if self.module is None:
            return None
        try:
            __import__(self.module)
        except ImportError as e:
            return f"not installed ({e})"
        return None

    def prepare(self, tag: str):
        """What both processes share, made in the parent before the fork."""
        return None

    def open(self, state, role: int, mode: str) -> Endpoint:
        raise NotImplementedError

    def cleanup(self, state) -> None:
        pass


# --- the baseline: a Unix socket pair ------------------------------------------------------


class _SocketEnd(Endpoint):
    def __init__(self, sock: socket.socket, spin_ns: int):
        self.sock = sock
        self.spin_ns = spin_ns
        self.buf = bytearray(MSG_SIZE)
        self.view = memoryview(self.buf)

    def send(self, msg):
        self.sock.sendall(msg)

    def _finish(self, n):
        # a stream: 64 bytes normally come whole, but nothing promises it
        while n < MSG_SIZE:
            got = self.sock.recv_into(self.view[n:], MSG_SIZE - n)
            if not got:
                raise EOFError("peer closed")
            n += got
        return bytes(self.buf)

    def _try(self):
        try:
            n = self.sock.recv_into(self.buf, MSG_SIZE, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        return self._finish(n)

    def recv(self):
        got = self._spun()
        if got is not None:
            return got
        return self._finish(self.sock.recv_into(self.buf, MSG_SIZE))


class SocketPair(Candidate):
    name = "socketpair"
    fd_wait = "yes (the socket)"

    def prepare(self, tag):
        return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def open(self, state, role, mode):
        mine, other = state[role], state[1 - role]
        other.close()
        return _SocketEnd(mine, SPIN_US * 1000 if mode == "spin" else 0)

    def cleanup(self, state):
        for s in state:
            s.close()


# --- the standard library: rings in SharedMemory, woken by an eventfd ---------------------


class _Ring:
    """One direction's single-producer single-consumer ring in shared memory.

    The producer owns the tail, the consumer the head and the asleep flag; each counter has a
    64-byte line of its own so that the two processes do not write the same cache line. A
    counter is an aligned 8-byte store through a memoryview (one mov on x86), written after the
    slot: x86 keeps stores in order (elsewhere this would need a fence, which Python lacks).
    """

    HEAD, TAIL, ASLEEP, SLOTS = 0, 64, 128, 192
    SIZE = SLOTS + RING_SLOTS * MSG_SIZE

    def __init__(self, buf: memoryview, offset: int):
        self.buf = buf[offset : offset + self.SIZE]
        self.head = self.buf[self.HEAD : self.HEAD + 8].cast("Q")
        self.tail = self.buf[self.TAIL : self.TAIL + 8].cast("Q")
        self.asleep = self.buf[self.ASLEEP : self.ASLEEP + 8].cast("Q")
        self.pos = 0  # this process's own counter (the tail it writes or the head it reads)

    def push(self, msg):
        t = self.pos
        if t - self.head[0] >= RING_SLOTS:
            raise RuntimeError("ring full")  # (never in a ping-pong)
        off = self.SLOTS + (t % RING_SLOTS) * MSG_SIZE
        self.buf[off : off + MSG_SIZE] = msg
        self.tail[0] = self.pos = t + 1

    def ready(self):
        """True if a message waits, else None (for _spin)."""
        return True if self.tail[0] != self.pos else None

    def pop(self):
        h = self.pos
        if self.tail[0] == h:
            return None
        off = self.SLOTS + (h % RING_SLOTS) * MSG_SIZE
        msg = bytes(self.buf[off : off + MSG_SIZE])
        self.head[0] = self.pos = h + 1
        return msg

    def release(self):
        for v in (self.head, self.tail, self.asleep, self.buf):
            v.release()


def _rings(shm, role):
    """(the ring this role writes, the ring it reads): ring 0 carries A -> B, ring 1 B -> A."""
    buf = shm.buf
    a_to_b, b_to_a = _Ring(buf, 0), _Ring(buf, _Ring.SIZE)
    return (a_to_b, b_to_a) if role == 0 else (b_to_a, a_to_b)


def _drain_eventfd(fd):
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass  # another wake-up already took it


class _EventfdRingEnd(Endpoint):
    def __init__(self, shm, role, wake_fd, wait_fd, mode):
        self.shm = shm
        self.out, self.inp = _rings(shm, role)
        self.wake_fd = wake_fd
        self.spin_ns = SPIN_US * 1000 if mode.startswith("spin") else 0
        self.flag = mode == "spin-flag"
        # a poll object registered once: select.select() would build its sets on every call
        self.poller = select.poll()
        self.poller.register(wait_fd, select.POLLIN)
        self.wait_fd = wait_fd
        self.writes = self.sends = self.lost = 0

    def send(self, msg):
        self.out.push(msg)
        self.sends += 1
        if not self.flag or self.out.asleep[0]:
            os.eventfd_write(self.wake_fd, 1)
            self.writes += 1

    def recv(self):
        msg = self.inp.pop()
        if msg is None and self.spin_ns:
            msg = _spin(self.inp.pop, self.spin_ns)
        while msg is None:
            if self.flag:
                self.inp.asleep[0] = 1
                msg = self.inp.pop()  # it may have come before the writer saw the flag
                if msg is None:
                    woken = self.poller.poll(BACKSTOP_MS)
                    if woken:
                        _drain_eventfd(self.wait_fd)
                    msg = self.inp.pop()
                    # a time-out with a message waiting: the writer did not see the flag (a
                    # time-out with none is only a writer that took over 1 ms)
                    self.lost += not woken and msg is not None
                self.inp.asleep[0] = 0
            else:
                self.poller.poll()
                _drain_eventfd(self.wait_fd)
                msg = self.inp.pop()
        return msg

    def stats(self):
        return {"eventfd_writes_per_msg": self.writes / max(self.sends, 1), "lost_wakeups": self.lost}

    def close(self):
        # the ring's views pin the mapping: SharedMemory.close() refuses while they live
        self.out.release()
        self.inp.release()
        self.shm.close()


class StdlibEventfd(Candidate):
    name = "stdlib-eventfd"
    modes = ("block", "spin", "spin-flag")
    fd_wait = "yes (the eventfd)"

    def missing(self):
        return None if hasattr(os, "eventfd") else "os.eventfd needs Linux and Python 3.10+"

    def prepare(self, tag):
        shm = shared_memory.SharedMemory(create=True, size=2 * _Ring.SIZE)
        shm.buf[:] = bytes(shm.size)
        flags = os.EFD_NONBLOCK | os.EFD_CLOEXEC
        return shm, (os.eventfd(0, flags), os.eventfd(0, flags))  # (wakes B, wakes A)

    def open(self, state, role, mode):
        shm, efds = state
        return _EventfdRingEnd(shm, role, wake_fd=efds[role], wait_fd=efds[1 - role], mode=mode)

    def cleanup(self, state):
        shm, efds = state
        shm.close()
        shm.unlink()
        for fd in efds:
            os.close(fd)


# --- posix_ipc: message queues, and semaphores on the rings above ---------------------------


class _MqEnd(Endpoint):
    def __init__(self, out_name, in_name, mode):
        import posix_ipc

        self.busy = posix_ipc.BusyError
        # each process opens its own descriptors: O_NONBLOCK belongs to the open description,
        # which a forked child would share with its peer
        self.out = posix_ipc.MessageQueue(out_name, read=False)
        self.inp = posix_ipc.MessageQueue(in_name, write=False)
        # polling needs a non-blocking descriptor: receive(timeout=0) is mq_timedreceive with a
        # deadline of now, which the kernel may sleep past (timer slack), not a non-blocking read
        self.inp_nb = posix_ipc.MessageQueue(in_name, write=False)
        self.inp_nb.block = False
        self.mode = mode
        self.spin_ns = SPIN_US * 1000 if mode == "spin" else 0
        self.poller = select.poll()
        self.poller.register(self.inp_nb.mqd, select.POLLIN)

    def send(self, msg):
        self.out.send(msg)

    def _try(self):
        try:
            return self.inp_nb.receive()[0]
        except self.busy:  # (EAGAIN)
            return None

    def recv(self):
        if self.mode == "fd":
            while True:
                msg = self._try()
                if msg is not None:
                    return msg
                self.poller.poll()
        msg = self._spun()
        if msg is not None:
            return msg
        return self.inp.receive()[0]

    def close(self):
        for q in (self.out, self.inp, self.inp_nb):
            q.close()


class PosixMq(Candidate):
    name = "posix_ipc-mq"
    dist = module = "posix_ipc"
    modes = ("block", "spin", "fd")
    fd_wait = "yes (mqd, Linux only)"

    def prepare(self, tag):
        import posix_ipc

        return [
            posix_ipc.MessageQueue(
                f"/ctrlcomm-bench-{tag}-{d}", posix_ipc.O_CREX, max_messages=8, max_message_size=MSG_SIZE
            )
            for d in ("ab", "ba")
        ]

    def open(self, state, role, mode):
        ab, ba = (q.name for q in state)
        return _MqEnd(ab, ba, mode) if role == 0 else _MqEnd(ba, ab, mode)

    def cleanup(self, state):
        for q in state:
            q.unlink()
            q.close()


class _SemRingEnd(Endpoint):
    def __init__(self, shm, role, sem_out, sem_in, mode):
        self.shm = shm
        self.out, self.inp = _rings(shm, role)
        self.sem_out, self.sem_in = sem_out, sem_in
        self.spin_ns = SPIN_US * 1000 if mode == "spin" else 0

    def send(self, msg):
        self.out.push(msg)
        self.sem_out.release()  # glibc: a futex wake only when the reader sleeps

    def recv(self):
        if self.spin_ns:
            # spin on the ring itself (no exception per miss); the semaphore's count, posted
            # after the push, is then taken without sleeping (or after a very short sleep)
            _spin(self.inp.ready, self.spin_ns)
        self.sem_in.acquire()
        return self.inp.pop()

    def close(self):
        self.out.release()
        self.inp.release()
        self.shm.close()


class PosixSem(Candidate):
    name = "posix_ipc-sem"
    dist = module = "posix_ipc"
    fd_wait = "no (futex)"

    def prepare(self, tag):
        import posix_ipc

        shm = shared_memory.SharedMemory(create=True, size=2 * _Ring.SIZE)
        shm.buf[:] = bytes(shm.size)
        sems = [posix_ipc.Semaphore(f"/ctrlcomm-bench-{tag}-{d}", posix_ipc.O_CREX) for d in ("ab", "ba")]
        return shm, sems

    def open(self, state, role, mode):
        shm, (ab, ba) = state
        return _SemRingEnd(shm, role, ab, ba, mode) if role == 0 else _SemRingEnd(shm, role, ba, ab, mode)

    def cleanup(self, state):
        shm, sems = state
        shm.close()
        shm.unlink()
        for s in sems:
            s.unlink()  # (unlink first: a closed Semaphore refuses unlink())
            s.close()


# --- faster-fifo ------------------------------------------------------------------------------


class _FifoEnd(Endpoint):
    def __init__(self, out, inp, mode):
        from queue import Empty

        self.empty = Empty
        self.out, self.inp = out, inp
        self.spin_ns = SPIN_US * 1000 if mode == "spin" else 0

    def send(self, msg):
        self.out.put(msg)

    def _try(self):
        try:
            return self.inp.get_nowait()
        except self.empty:
            return None

    def recv(self):
        msg = self._spun()
        if msg is not None:
            return msg
        while True:
            try:
                # get()'s timeout defaults to 10 s (then queue.Empty): a blocking get must loop
                return self.inp.get(timeout=10.0)
            except self.empty:
                pass


class FasterFifo(Candidate):
    name = "faster-fifo"
    dist = "faster-fifo"
    module = "faster_fifo"
    fd_wait = "no (process-shared condvar)"

    def prepare(self, tag):
        from faster_fifo import Queue

        # bytes in, bytes out: the default pickles every message
        return [Queue(max_size_bytes=64 * 1024, loads=bytes, dumps=bytes) for _ in range(2)]

    def open(self, state, role, mode):
        ab, ba = state
        return _FifoEnd(ab, ba, mode) if role == 0 else _FifoEnd(ba, ab, mode)


# --- iceoryx2 ---------------------------------------------------------------------------------


class _IoxEnd(Endpoint):
    def __init__(self, tag, role, mode):
        import ctypes

        import iceoryx2 as iox2

        class Payload(ctypes.Structure):
            _fields_ = [("data", ctypes.c_uint8 * MSG_SIZE)]

        self.payload = Payload
        # (quiets its notice that no config file was found and defaults are used)
        iox2.set_log_level(iox2.LogLevel.Error)
        self.node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)
        out_dir, in_dir = ("ab", "ba") if role == 0 else ("ba", "ab")
        self.services = []

        def service(direction):
            name = iox2.ServiceName.new(f"ctrlcomm-bench/{tag}/{direction}")
            ps = self.node.service_builder(name).publish_subscribe(Payload).open_or_create()
            ev = self.node.service_builder(name).event().open_or_create()
            self.services += [ps, ev]
            return ps, ev

        ps, ev = service(out_dir)
        self.pub = ps.publisher_builder().create()
        self.notifier = ev.notifier_builder().create()
        ps, ev = service(in_dir)
        self.sub = ps.subscriber_builder().create()
        self.listener = ev.listener_builder().create()
        self.spin_ns = SPIN_US * 1000 if mode == "spin" else 0

    def send(self, msg):
        self.pub.send_copy(self.payload.from_buffer_copy(msg))
        self.notifier.notify()

    def _try(self):
        sample = self.sub.receive()
        if sample is None:
            return None
        msg = bytes(sample.payload().contents)
        sample.delete()  # back to the publisher's pool now, not when the GC gets to it
        return msg

    def recv(self):
        msg = self._spun()
        if msg is not None:
            return msg
        while True:
            msg = self._try()
            if msg is not None:
                return msg
            # returns the pending activations; one may be stale (from a message the spin
            # took), then the loop finds no sample and waits again
            self.listener.blocking_wait()

    def close(self):
        # the child leaves through os._exit: without this its ports, services and node would
        # stay behind in /dev/shm and /tmp/iceoryx2
        for port in (self.pub, self.notifier, self.sub, self.listener):
            port.delete()
        del self.pub, self.notifier, self.sub, self.listener, self.services, self.node
        gc.collect()


class Iceoryx2(Candidate):
    name = "iceoryx2"
    dist = module = "iceoryx2"
    # (its Listener is a Unix datagram socket inside, but the Python API gives no descriptor;
    # a WaitSet takes other descriptors but gives none of its own)
    fd_wait = "no (not in the Python API)"

    def prepare(self, tag):
        return tag  # each process makes its own node: nothing of iceoryx2's crosses the fork

    def open(self, state, role, mode):
        return _IoxEnd(state, role, mode)


CANDIDATES = [SocketPair(), StdlibEventfd(), PosixMq(), PosixSem(), FasterFifo(), Iceoryx2()]


# --- the two processes ------------------------------------------------------------------------


def _message(i):
    return i.to_bytes(8, "little") + bytes(MSG_SIZE - 8)


def _client(end, n, warmup):
    """A: sends, waits for the echo, times each round trip."""
    for i in range(warmup):
        end.send(_message(i))
        end.recv()
    msgs = [_message(warmup + i) for i in range(n)]
    rtts = [0] * n
    bad = 0
    clock = time.perf_counter_ns
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for i in range(n):
        m = msgs[i]
        t0 = clock()
        end.send(m)
        r = end.recv()
        rtts[i] = clock() - t0
        bad += r != m
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    if bad:
        raise RuntimeError(f"{bad} echoes did not match")
    rtts.sort()
    p99 = rtts[min(n - 1, int(0.99 * n))]
    return {"median_ns": statistics.median(rtts), "p99_ns": p99, "cpu": cpu, "wall": wall}


def _server(end, n, warmup):
    """B: echoes every message."""
    for _ in range(warmup):
        end.send(end.recv())
    cpu0 = time.process_time()
    for _ in range(n):
        end.send(end.recv())
    return {"cpu": time.process_time() - cpu0}


def _child(cand, state, role, mode, n, warmup, barrier, conn):
    try:
        # A opens first, then B: iceoryx2's open_or_create of one service by two processes at
        # once can collide; the other candidates do not care
        if role == 1:
            barrier.wait()
        end = cand.open(state, role, mode)
        if role == 0:
            barrier.wait()
        barrier.wait()  # both ends open before the first message
        result = (_client if role == 0 else _server)(end, n, warmup)
        result.update(end.stats())
        end.close()
        conn.send(result)
    except BaseException as e:  # reported by the parent, which goes on with the next one
        conn.send({"error": f"{type(e).__name__}: {e}"})
        barrier.abort()


_runs = 0


def run_pair(cand, mode, n, warmup):
    """One run of cand in mode: the figures, or {'error': why}."""
    global _runs
    _runs += 1
    ctx = mp.get_context("fork")  # the eventfds and mappings are inherited, not passed
    try:
        state = cand.prepare(f"{os.getpid()}-{_runs}")
    except Exception as e:
        return {"error": f"setup: {type(e).__name__}: {e}"}
    barrier = ctx.Barrier(2, timeout=30)
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [
        ctx.Process(target=_child, args=(cand, state, role, mode, n, warmup, barrier, pipes[role][1]))
        for role in (0, 1)
    ]
    for p in procs:
        p.start()
    limit = time.monotonic() + 30 + n * 0.002  # a slow run takes ~0.2 ms a round trip
    results = []
    for reader, _ in pipes:
        if reader.poll(max(0.0, limit - time.monotonic())):
            results.append(reader.recv())
        else:
            results.append({"error": "timed out"})
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
    try:
        cand.cleanup(state)
    except Exception as e:
        print(f"  ({cand.name}: cleanup failed: {e})", file=sys.stderr)
    errors = [f"{'AB'[i]}: {r['error']}" for i, r in enumerate(results) if "error" in r]
    if errors:
        return {"error": "; ".join(errors)}
    a, b = results
    out = {
        "median_us": a["median_ns"] / 1000,
        "p99_us": a["p99_ns"] / 1000,
        "cpu_us": (a["cpu"] + b["cpu"]) / n * 1e6,
        "cpu_per_wall": (a["cpu"] + b["cpu"]) / a["wall"],
    }
    if "lost_wakeups" in a:
        out["eventfd_writes_per_msg"] = (a["eventfd_writes_per_msg"] + b["eventfd_writes_per_msg"]) / 2
        out["lost_wakeups"] = a["lost_wakeups"] + b["lost_wakeups"]
    return out


def install_notes(cand):
    """Version, installed size, what else it pulls in (from the installed distribution)."""
    if cand.dist is None:
        return "standard library"
    try:
        dist = importlib.metadata.distribution(cand.dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
    size = 0
    for f in dist.files or []:
        try:
            size += os.path.getsize(f.locate())
        except OSError:
            pass
    requires = [r for r in (dist.requires or []) if "extra ==" not in r]
    requires_txt = ", ".join(requires) or "nothing"
    return f"{cand.dist} {dist.version}, {size / 1e6:.1f} MB installed, requires: {requires_txt}"


def main(argv):
    n = int(argv[1]) if len(argv) > 1 else 20000
    rounds = int(argv[2]) if len(argv) > 2 else 3
    only = set(argv[3].split(",")) if len(argv) > 3 else None
    warmup = min(WARMUP, max(n // 4, 10))
    print(f"# Linux {platform.release()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"# N={n} round trips of {MSG_SIZE} B after {warmup} warm-up, {rounds} rounds, spin {SPIN_US} us")
    print(f"# load average at start: {os.getloadavg()}")
    pairs = []
    for cand in CANDIDATES:
        if only is not None and cand.name not in only:
            continue
        why = cand.missing()
        if why:
            print(f"# skipping {cand.name}: {why}")
            continue
        pairs += [(cand, mode) for mode in cand.modes]
    runs: dict[tuple[str, str], list[dict]] = {(c.name, m): [] for c, m in pairs}
    for r in range(rounds):
        order = pairs if r % 2 == 0 else pairs[::-1]  # alternate, so drift spreads over all
        for cand, mode in order:
            res = run_pair(cand, mode, n, warmup)
            runs[cand.name, mode].append(res)
            if "error" in res:
                print(f"round {r + 1}: {cand.name:15} {mode:9} FAILED: {res['error']}", flush=True)
            else:
                extra = ""
                if "lost_wakeups" in res:
                    writes, lost = res["eventfd_writes_per_msg"], res["lost_wakeups"]
                    extra = f" eventfd writes/msg {writes:.2f} lost wake-ups {lost}"
                print(
                    f"round {r + 1}: {cand.name:15} {mode:9} median {res['median_us']:7.1f} us"
                    f"  p99 {res['p99_us']:7.1f} us  cpu {res['cpu_us']:6.1f} us/rt"
                    f"  cpu/wall {res['cpu_per_wall']:.2f}{extra}",
                    flush=True,
                )
    print(f"# load average at end: {os.getloadavg()}")
    print()
    print("| candidate | mode | median us | p99 us | CPU us / rt | CPU/wall | waits on an fd | medians |")
    print("|---|---|---|---|---|---|---|---|")
    for cand, mode in pairs:
        ok = [x for x in runs[cand.name, mode] if "error" not in x]
        if not ok:
            why = runs[cand.name, mode][0]["error"]
            print(f"| {cand.name} | {mode} | failed: {why} | | | | {cand.fd_wait} | |")
            continue

        def med(key, ok=ok):
            return statistics.median(x[key] for x in ok)

        rounds_txt = " / ".join(f"{x['median_us']:.1f}" for x in ok)
        print(
            f"| {cand.name} | {mode} | {med('median_us'):.1f} | {med('p99_us'):.1f} | {med('cpu_us'):.1f}"
            f" | {med('cpu_per_wall'):.2f} | {cand.fd_wait} | {rounds_txt} |"
        )
    print()
    for cand in CANDIDATES:
        print(f"- {cand.name}: {install_notes(cand)}")


if __name__ == "__main__":
    main(sys.argv)
