"""Liveness: UDP heartbeats between the ranks of a group, sent and read on a daemon thread,
and a look at a silent same-host peer's CPU time (``/proc``) to tell a busy process from a
hung one."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading
import time

from ._net import _dual_stack, _numeric, _proc_stat

# ------------------------------------------------------------------------- liveness


# A silent same-host peer that used at least this share of a CPU since the last look runs
# (Heartbeat.running). One long C call uses a whole CPU, or its share of one where processes
# outnumber CPUs; a hung process's threads waiting for the GIL use about 0.1%.
RUNNING_CPU_SHARE = 0.05
# running() judges a process by its CPU time over at least RUNNING_WINDOW_S (its CPU times
# move in ticks of 1/CLK_TCK s); a look older than RUNNING_STALE_S starts a new window.
RUNNING_WINDOW_S = 0.2
RUNNING_STALE_S = 2.0
try:
    _CLK_TCK = float(os.sysconf("SC_CLK_TCK"))  # the unit of CPU times in /proc
except (AttributeError, OSError, ValueError):
    _CLK_TCK = 100.0


class Heartbeat:
    """Tells peers this process is alive, and notes when each peer last said so.

    A daemon thread sends one small UDP datagram per peer every ``interval`` seconds and
    records the peers' datagrams. It runs beside the caller's thread, so a rank that is busy
    elsewhere, or idle, still answers; a process that is stopped (SIGSTOP), hung with the GIL
    held, or cut off from the network falls silent. The cost is one datagram per peer per
    interval and one wake-up per interval.

    The thread needs the GIL: while a long C call holds it, the process sends nothing and
    reads nothing. Two things keep that from being taken for a lost peer: a check reads the
    heartbeats waiting in the socket first (:meth:`catch_up`), and a silent peer on this host
    (the same kernel, network and PID namespace) whose process runs is waited for a while
    longer; a stopped, exited or hung one is lost (:meth:`running`).

    Datagram: group id (8 bytes), sender rank (4 bytes), beat number (8 bytes: 1, 2, 3...),
    then a MAC, with the group's key, of those and of the rank it is sent to (a forged
    heartbeat could otherwise hide a dead peer). A beat whose number is not above the last
    one taken from its sender is dropped: a recorded heartbeat replayed, to its rank or to
    another, cannot hide a stopped peer either. (``key`` may be given once the group is
    formed, before :meth:`start`: the socket's port is part of the address a rank publishes.)
    """

    FMT = struct.Struct("<QIQ")

    def __init__(self, bind_host: str, group_id: int, rank: int, key: bytes | None,
                 interval: float) -> None:
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        _dual_stack(self.sock, bind_host)
        self.sock.bind((bind_host, 0))
        self.port = int(self.sock.getsockname()[1])
        self.group_id, self.rank, self.key, self.interval = group_id, rank, key, interval
        self.sock.settimeout(interval)  # (non-blocking at the OS level: see catch_up)
        self.peers: dict[int, tuple[str, int]] = {}
        self.procs: dict[int, tuple[int, int]] = {}  # same-host peers: (pid, start time)
        self._cpu_seen: dict[int, tuple[float, float]] = {}  # their (time, CPU s) last looked
        self._running: dict[int, bool] = {}  # what the last look over a window found
        self.last_seen: dict[int, float] = {}
        self.beats: dict[int, int] = {}  # the number of the last beat taken from each peer
        self.dropped: dict[str, int] = {}  # datagrams dropped, by reason (Group.stats)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _mac(self, body: bytes, dst: int) -> bytes:
        assert self.key, "a heartbeat's key is set before it starts"
        return hashlib.blake2b(b"hb" + body + struct.pack("<q", dst), key=self.key,
                               digest_size=16).digest()

    def datagram(self, dst: int, n: int) -> bytes:
        """Beat number ``n`` of this rank, for rank ``dst``."""
        body = self.FMT.pack(self.group_id, self.rank, n)
        return body + self._mac(body, dst)

    def start(self, peers: dict[int, tuple[str, int]],
              procs: dict[int, tuple[int, int]] | None = None) -> None:
        """Start beating to ``peers`` (``{rank: (host, udp port)}``); ``procs``: the
        same-host ones' ``(pid, start time)`` (:func:`same_host_procs`)."""
        if self.sock.family == socket.AF_INET6:
            # (bound to "::", every interface, both families: an IPv4 peer is sent to as
            # ::ffff:a.b.c.d; sendto an IPv4 address failed, unseen, and the peer found this
            # rank silent)
            peers = {r: (f"::ffff:{h}" if _numeric(h) and ":" not in h else h, p)
                     for r, (h, p) in peers.items()}
        self.peers = dict(peers)
        self.procs = dict(procs or {})
        now = time.monotonic()
        self.last_seen = dict.fromkeys(peers, now)  # grace: a new group counts as seen
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"ctrlcomm-heartbeat:{self.rank}")
        self._thread.start()

    def _run(self) -> None:
        next_send = 0.0
        n = 0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_send:
                n += 1
                for dst, addr in self.peers.items():
                    try:
                        self.sock.sendto(self.datagram(dst, n), addr)
                    except OSError:
                        pass  # unreachable now; the peer's silence is what we report
                next_send = now + self.interval
            try:
                # (in the try too: close() closes the socket after waiting a second for this
                # thread, which a starved process may not have run by then)
                self.sock.settimeout(max(next_send - time.monotonic(), 0.001))
                data = self.sock.recv(64)
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            self._accept(data)

    def _drop(self, why: str) -> None:
        why = "heartbeat_" + why
        self.dropped[why] = self.dropped.get(why, 0) + 1

    def _accept(self, data: bytes) -> None:
        n = self.FMT.size
        if len(data) != n + 16:
            if data or not self._stop.is_set():  # (not close()'s wake-up)
                self._drop("malformed")
            return
        gid, src, beat = self.FMT.unpack_from(data)
        if gid != self.group_id or src not in self.peers:
            self._drop("other_group" if gid != self.group_id else "bad_src")
            return
        if not hmac.compare_digest(self._mac(data[:n], self.rank), data[n:]):
            self._drop("unauthenticated")
            return
        if beat <= self.beats.get(src, 0):  # a replay (or one overtaken on the way)
            self._drop("replayed")
            return
        self.beats[src] = beat
        self.last_seen[src] = time.monotonic()

    def catch_up(self) -> None:
        """Read the heartbeats waiting in the socket now. The thread reads them too, but not
        while a long C call of this process held the GIL: they wait in the socket then, and a
        check right after that call would find every peer silent. (At most a few per peer:
        datagrams anyone keeps sending cannot hold the caller here.)"""
        for _ in range(64 + 4 * len(self.peers)):
            fd = self.sock.fileno()
            if fd < 0:  # closed
                return
            try:
                # os.read, not recv: a socket with a timeout polls before it reads, and the
                # thread may take the datagram in between (the descriptor is non-blocking)
                data = os.read(fd, 64)
            except OSError:  # none left (EAGAIN), or closed
                return
            self._accept(data)

    def running(self, rank: int) -> bool | None:
        """Whether silent peer ``rank`` is a process of this host that runs, as while one long
        C call holds its GIL and so keeps its heartbeat thread from sending: it used at least
        :data:`RUNNING_CPU_SHARE` of a CPU over the last window (RUNNING_WINDOW_S at least; a
        look within one answers what the last window found). False for a peer elsewhere, a
        process that is stopped (SIGSTOP), has exited, or used less (hung: its threads wait,
        the ones waiting for the GIL wake for a few microseconds every 5 ms). None on a first
        look at a process that is neither stopped nor gone: look again shortly."""
        p = self.procs.get(rank)
        if p is None:
            return False
        pid, start = p
        try:
            fields = _proc_stat(f"/proc/{pid}/stat")
            if int(fields[19]) != start:
                return False  # that process is gone; another has its pid
            if fields[0] in (b"T", b"t", b"Z", b"X"):
                return False  # stopped (or traced), or exited
            cpu = (int(fields[11]) + int(fields[12])) / _CLK_TCK  # user + system, all threads
        except (OSError, ValueError, IndexError):
            return False
        now = time.monotonic()
        before = self._cpu_seen.get(rank)
        if before is None or now - before[0] > RUNNING_STALE_S:
            self._cpu_seen[rank] = (now, cpu)
            self._running.pop(rank, None)
            return None
        if now - before[0] < RUNNING_WINDOW_S:
            # CPU times move in ticks (10 ms): looks closer than this cannot tell a running
            # process from a hung one (a busy loop of calls looks again and again): what the
            # last window found (stopped or gone, seen above, at once)
            return self._running.get(rank)
        self._cpu_seen[rank] = (now, cpu)
        runs = self._running[rank] = cpu - before[1] >= RUNNING_CPU_SHARE * (now - before[0])
        return runs

    def silent_for(self, rank: int, now: float) -> float:
        """Seconds since ``rank`` was last heard from (0 for unknown ranks)."""
        seen = self.last_seen.get(rank)
        return 0.0 if seen is None else now - seen

    def close(self) -> None:
        self._stop.set()
        try:  # wake the thread out of recv at once
            self.sock.sendto(b"", self.sock.getsockname()[:2])
        except OSError:
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        self.sock.close()
