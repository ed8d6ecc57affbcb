"""The shared-memory byte ring that carries a same-host peer's stream (``transport="shm"``).

One :class:`Ring` is one direction of one pair of ranks: a single-producer single-consumer
ring of bytes in an anonymous memory file (``memfd_create``), plus two eventfds: ``data``,
written by the writer after it wrote (the reader sleeps on it in its endpoint's epoll set),
and ``room``, written by the reader where the writer said it waits for room. The writer
makes all three and hands them to the reader over the abstract Unix socket the pair
connected on (``SCM_RIGHTS``, :func:`send_fds`); that socket then carries nothing more, and
its end tells either side that the other is gone, as it does for a plain Unix connection.

Why an anonymous memory file, not ``multiprocessing.shared_memory``: it has no name, so no
segment can outlive the processes that hold it (a kill -9 included), and nobody who was not
handed its descriptor can open it. Why eventfds: a reader waits on them in the same epoll
set as its sockets (and asyncio's ``add_reader``), and ``benchmarks/shm_candidates.py``
measured the ring with them the fastest of the candidates (see benchmarks/README.md).

The counters are 64-bit words at cache-line distance, each written by one side only:
``head`` (bytes written, the writer's), ``tail`` (bytes read, the reader's) and ``waits``
(how often the writer waited for room, the writer's). A reader that sees ``head`` move sees
the bytes written before it on x86-64 (stores are not reordered with stores, nor loads with
loads); a wake-up through an eventfd is a system call on both sides, ordered everywhere.
Each side checks what the other wrote: a count that cannot be raises ``OSError``, which
the endpoint takes as a lost connection.
"""

from __future__ import annotations

import array
import errno
import fcntl
import mmap
import os
import platform
import socket
from collections.abc import Sequence
from typing import Any

# Where rings are used: the counters are plain loads and stores from Python, which has no
# memory fence, and only x86-64 keeps stores in order with stores and loads with loads (and
# a reader's loads before its store of the read count): elsewhere (ARM) a reader could see a
# count before the bytes it counts, and "shm" sends over the Unix sockets instead
AVAILABLE = platform.machine().lower() in ("x86_64", "amd64")
CONTROL = 4096  # bytes before the ring's data: the counters, a page
_HEAD, _TAIL, _WAITS = 0, 8, 16  # the counters' indexes as 64-bit words (a cache line apart)
MIN_RING, MAX_RING = 64 * 1024, 16 * 1024 * 1024
RING_BUDGET = 64 * 1024 * 1024  # the rings one rank writes, at most, all peers together
HANDOVER = b"\x00"  # the byte that carries the descriptors
_FDS = 3
# A ring's memory file is sealed at its size: one that shrank under a reader's mapping would
# kill the reader (SIGBUS) as it read past the end
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_CLOSED = memoryview(bytes(CONTROL)).cast("Q")  # a closed ring's counters: nothing to read


def ring_size(local_peers: int) -> int:
    """The data bytes of each ring a rank with ``local_peers`` same-host peers writes: 1 MiB,
    less where that many would pass RING_BUDGET (a power of two, MIN_RING at least)."""
    size = 1024 * 1024
    while size > MIN_RING and size * max(local_peers, 1) > RING_BUDGET:
        size //= 2
    return size


class Ring:
    """One end (``writer`` or not) of a ring: see the module's docstring. ``send``,
    ``sendmsg`` and ``recv_into`` behave as a non-blocking socket's do (``BlockingIOError``
    where the ring is full or empty), so the endpoint uses either alike."""

    __slots__ = ("writer", "size", "mask", "mm", "ctl", "data", "data_fd", "room_fd",
                 "_signalled", "memfd")

    def __init__(self, memfd: int, data_fd: int, room_fd: int, writer: bool) -> None:
        st = os.fstat(memfd)
        size = st.st_size - CONTROL
        if size < MIN_RING or size > MAX_RING or size & (size - 1):
            raise OSError(errno.EPROTO, f"a shared ring of {st.st_size} bytes")
        if fcntl.fcntl(memfd, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
            raise OSError(errno.EPROTO, "a shared ring whose size is not sealed")
        self.writer = writer
        self.size, self.mask = size, size - 1
        self.mm = mmap.mmap(memfd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        view = memoryview(self.mm)
        self.ctl = view[:CONTROL].cast("Q")
        self.data = view[CONTROL:]
        self.memfd = memfd
        self.data_fd, self.room_fd = data_fd, room_fd
        self._signalled = 0  # (the reader's) the writer's waits answered

    @classmethod
    def create(cls, size: int) -> Ring:
        """A new ring of ``size`` data bytes (a power of two), this process its writer."""
        memfd = os.memfd_create("ctrlcomm-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        fds = [memfd]
        try:
            os.fchmod(memfd, 0o600)
            os.ftruncate(memfd, CONTROL + size)
            fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, _SEALS)
            fds.append(os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))
            fds.append(os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))
            return cls(fds[0], fds[1], fds[2], writer=True)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def fds(self) -> list[int]:
        return [self.memfd, self.data_fd, self.room_fd]

    @property
    def fd(self) -> int:
        """The eventfd this end waits on: ``data`` (reader), ``room`` (writer)."""
        return self.room_fd if self.writer else self.data_fd

    def fileno(self) -> int:
        return self.fd

    # ------------------------------------------------------------------ the writer's

    def _used(self) -> int:
        ctl = self.ctl
        used = ctl[_HEAD] - ctl[_TAIL]
        if not 0 <= used <= self.size:
            raise OSError(errno.EPROTO, "the shared ring's read count is past its write count")
        return used

    def send(self, data: Any) -> int:
        """Copy what fits of ``data`` into the ring; the bytes copied (BlockingIOError: none
        fit)."""
        return self.sendmsg((data,))

    def sendmsg(self, parts: Sequence[Any]) -> int:
        """Copy what fits of ``parts``, in order, into the ring, and wake the reader; the
        bytes copied (BlockingIOError: none fit). Where the ring is full then, the reader is
        asked for room (:meth:`_ask`)."""
        free = self.size - self._used()
        if not free:
            self._ask()
            raise BlockingIOError(errno.EAGAIN, "shared ring full")
        ctl, data, mask, size = self.ctl, self.data, self.mask, self.size
        head = ctl[_HEAD]
        done = 0
        for p in parts:
            v = p if type(p) is memoryview else memoryview(p)
            if v.ndim != 1 or v.itemsize != 1:
                v = v.cast("B")
            n = min(v.nbytes, free - done)
            pos = (head + done) & mask
            first = min(n, size - pos)
            data[pos:pos + first] = v[:first]
            if n > first:
                data[:n - first] = v[first:n]
            done += n
            if done == free:
                break
        ctl[_HEAD] = head + done  # (after the bytes: what the reader may take)
        os.eventfd_write(self.data_fd, 1)
        if done == free:
            self._ask()
        return done

    def has_room(self) -> bool:
        return self._used() < self.size

    def _ask(self) -> None:
        """Ask the reader to write ``room`` when it next takes bytes out (the ring is full);
        where it took them before it could see the ask, ``room`` is written here."""
        self.ctl[_WAITS] += 1
        if self.has_room():
            os.eventfd_write(self.room_fd, 1)

    # ------------------------------------------------------------------ the reader's

    def ready(self) -> bool:
        """Whether bytes wait to be read (no system call: a spinning wait asks this, which
        may see the ring closed by another thread meanwhile: then none do)."""
        ctl = self.ctl
        try:
            return ctl[_HEAD] != ctl[_TAIL]
        except ValueError:  # (released as it was read)
            return False

    def recv_into(self, view: memoryview, n: int) -> int:
        """Copy at most ``n`` bytes that wait into ``view``; how many (BlockingIOError:
        none wait)."""
        ctl, data, size = self.ctl, self.data, self.size
        tail = ctl[_TAIL]
        avail = ctl[_HEAD] - tail
        if not avail:
            raise BlockingIOError(errno.EAGAIN, "shared ring empty")
        if not 0 < avail <= size:
            raise OSError(errno.EPROTO, "the shared ring's write count is past its room")
        k = min(avail, n)
        pos = tail & self.mask
        first = min(k, size - pos)
        view[:first] = data[pos:pos + first]
        if k > first:
            view[first:k] = data[:k - first]
        ctl[_TAIL] = tail + k
        waits = ctl[_WAITS]
        if waits != self._signalled:  # the writer waits for room: there is some now
            self._signalled = waits
            os.eventfd_write(self.room_fd, 1)
        return k

    def clear(self) -> None:
        """Take the wake-ups written to the eventfd this end waits on."""
        try:
            os.eventfd_read(self.fd)
        except OSError:  # (none: EAGAIN)
            pass

    def close(self) -> None:
        if self.memfd < 0:  # (closed already)
            return
        ctl, data = self.ctl, self.data
        self.ctl, self.data = _CLOSED, memoryview(b"")  # (the old views released below)
        ctl.release()
        data.release()
        try:
            self.mm.close()
        except BufferError:  # (a view of it is still exported: freed with it)
            pass
        for fd in (self.memfd, self.data_fd, self.room_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.memfd = self.data_fd = self.room_fd = -1


def send_fds(sock: socket.socket, ring: Ring) -> None:
    """Hand ``ring``'s memory file and eventfds to the peer on ``sock``, a Unix socket just
    connected (its buffer empty: the one byte goes at once, or the connection failed)."""
    sock.sendmsg([HANDOVER], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", ring.fds()))])


def recv_fds(sock: socket.socket) -> tuple[bytes, list[int]]:
    """The first byte of a new Unix connection, and the descriptors that came with it (a
    ring's three with HANDOVER: see :func:`send_fds`; none where the peer streams on the
    socket itself). Raises BlockingIOError where nothing came yet, OSError where the
    connection failed."""
    fds = array.array("i")
    data, anc, flags, _ = sock.recvmsg(1, socket.CMSG_SPACE(_FDS * fds.itemsize))
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    got = list(fds)
    if flags & socket.MSG_CTRUNC:  # more than a ring's: not a peer's
        for fd in got:
            os.close(fd)
        raise OSError(errno.EPROTO, "too many descriptors")
    return data, got


SPIN_US = 50.0  # the default spin budget (benchmarks/shm_candidates.py's spin mode)


def spin_budget(spin_us: float | None) -> float:
    """The seconds a wait on shared rings spins first: ``spin_us`` microseconds, else
    ``CTRLCOMM_SPIN_US``, else SPIN_US; 0 never spins. Raises ValueError for a negative or
    unreadable one."""
    where = "spin_us"
    if spin_us is None:
        env = os.environ.get("CTRLCOMM_SPIN_US", "").strip()
        if not env:
            return SPIN_US / 1e6
        where = "CTRLCOMM_SPIN_US"
        try:
            spin_us = float(env)
        except ValueError:
            raise ValueError(f"{where}={env!r} is not a number of microseconds") from None
    if isinstance(spin_us, bool) or not isinstance(spin_us, (int, float)) \
            or not 0 <= spin_us <= 1e6:
        raise ValueError(f"{where} must be a number of microseconds from 0 to 1000000, "
                         f"not {spin_us!r}")
    return float(spin_us) / 1e6
