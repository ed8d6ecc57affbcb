"""Names, addresses and this host: what the transports and the store share below sockets.

Looking names up within a deadline (``resolve``: a lookup runs in a thread that a timed-out
caller leaves behind), choosing the local address that routes to a host, binding, the
identity of this host and process (``host_id``, ``proc_address``: which peers share this
host, for the local sockets and the liveness checks), the shared ZeroMQ context, CurveZMQ
keys and socket monitors, and the warning for a store or group reachable without a key.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import ipaddress
import itertools
import logging
import os
import socket
import struct
import threading
import time
from typing import Any

import zmq
import zmq.utils.z85

from .._errors import CtrlcommError, StoreError, StoreTimeoutError

log = logging.getLogger("ctrlcomm")

_ctx: zmq.Context[Any] | None = None
_ctx_pid = -1
_ctx_lock = threading.Lock()

# Outgoing messages may wait this long for delivery after close (in ZeroMQ's I/O thread; the
# caller never blocks), so a group's last messages reach peers even if it closes at once.
LINGER_MS = 5000


def context() -> zmq.Context[Any]:
    """The process's ZeroMQ context (one I/O thread), made anew after a fork."""
    global _ctx, _ctx_pid
    with _ctx_lock:
        if _ctx is None or _ctx_pid != os.getpid():
            _ctx = zmq.Context(io_threads=1)
            _ctx.setsockopt(zmq.MAX_SOCKETS, 65536) if hasattr(zmq, "MAX_SOCKETS") else None
            _ctx_pid = os.getpid()
        return _ctx


def _numeric(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


# The names being looked up, each with its lookup's (event, answer): a caller that finds its
# name here waits for that lookup instead of starting another, so a resolver that hangs holds
# one thread per name, not one per try. (Forgotten in a forked child: the threads are not.)
_lookups: dict[str, tuple[threading.Event, list[Any]]] = {}
_lookups_lock = threading.Lock()


def _forget_lookups() -> None:
    global _lookups, _lookups_lock
    _lookups, _lookups_lock = {}, threading.Lock()


os.register_at_fork(after_in_child=_forget_lookups)


def _answer(host: str, answer: list[Any], done: threading.Event, value: Any) -> None:
    """Give the callers waiting on ``host``'s lookup its answer (addresses, or what was
    raised), and forget the lookup: the next caller starts another."""
    answer.append(value)
    with _lookups_lock:
        if _lookups.get(host, (None,))[0] is done:
            del _lookups[host]
    done.set()


def _look_up(host: str, answer: list[Any], done: threading.Event) -> None:
    value: Any
    try:
        try:  # (IPv4 first, as ZeroMQ and IPv4 sockets ask: /etc/hosts may give a name
            # "::1" alone when asked for any family, and 127.0.0.1 when asked for IPv4)
            infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
        except socket.gaierror:
            # (then any family, even where the IPv4 query failed on a DNS that is down: the
            # hosts file may hold the name's IPv6 address, and each caller has its deadline)
            infos = socket.getaddrinfo(host, None, 0, socket.SOCK_STREAM)
        value = infos
    except BaseException as e:  # noqa: BLE001  (handed to the callers)
        value = e
    _answer(host, answer, done, value)


def resolve(host: str, timeout: float) -> str:
    """``host``'s address, looked up within ``timeout`` seconds: a number as it is, a name as
    its first IPv4 address, or its first IPv6 one where it has none (ZeroMQ, given a name,
    looks for IPv4 only). Raises socket.gaierror where the name does not resolve (or
    UnicodeError), TimeoutError where the lookup took longer.

    The system's resolver has no deadline of its own: a DNS server that does not answer holds
    ``getaddrinfo`` for its timeout times its attempts, per server (5 s x 2 each by default),
    and ZeroMQ, given a name, looks it up in ``connect()`` and then again at each reconnection
    in its I/O thread, which every socket of the process shares. So a name is looked up here,
    in a thread this one waits for until the deadline (and leaves behind if it has not
    returned: nothing can stop a ``getaddrinfo``), and sockets are given numbers.
    """
    if _numeric(host):
        return host
    with _lookups_lock:
        entry = _lookups.get(host)
        fresh = entry is None
        if entry is None:
            entry = _lookups[host] = (threading.Event(), [])
    done, answer = entry
    if fresh:
        try:
            threading.Thread(target=_look_up, args=(host, answer, done),
                             name=f"ctrlcomm-resolve-{host}", daemon=True).start()
        except RuntimeError:  # (no thread can be started: looked up here, without deadline)
            _look_up(host, answer, done)
        except BaseException:  # (interrupted: the entry must not stay, waited for forever)
            _answer(host, answer, done,
                    socket.gaierror(socket.EAI_AGAIN, "the lookup was interrupted"))
            raise
    left = max(timeout, 0.0)
    if not done.wait(min(left, threading.TIMEOUT_MAX)):
        raise TimeoutError(f"looking up host {host!r} took longer than the {left:.3g} s left "
                           "(is its DNS server reachable?)")
    if isinstance(answer[0], socket.gaierror):  # (one per caller: callers may share it)
        raise socket.gaierror(answer[0].errno, answer[0].strerror)
    if isinstance(answer[0], BaseException):
        raise answer[0]
    infos = answer[0]
    if not infos:  # (never, by getaddrinfo's contract)
        raise socket.gaierror(socket.EAI_NONAME, f"{host!r} resolves to no address")
    return str(infos[0][4][0])


def local_address_for(host: str, port: int) -> str:
    """The address of this machine's interface that routes to ``host`` (no packet is sent;
    ``host`` a number, or a name looked up without a deadline: see :func:`resolve`)."""
    infos = socket.getaddrinfo(host, port, 0, socket.SOCK_DGRAM)
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return str(s.getsockname()[0])


def _wildcard(host: str) -> bool:
    """Whether ``host`` (a number) is an unspecified address: 0.0.0.0, ::, ::0..."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _dual_stack(sock: socket.socket, bind_host: str) -> None:
    """A socket to bind on the IPv6 wildcard takes IPv4 too (as Linux's default does; set
    here, not left to net.ipv6.bindv6only): peers given an IPv4 wildcard find it there."""
    if sock.family == socket.AF_INET6 and _wildcard(bind_host):
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)


def _tcp(host: str, port: int | str) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"tcp://[{host}]:{port}"
    except ValueError:
        pass
    return f"tcp://{host}:{port}"


def _is_v6(endpoint: str) -> bool:
    return endpoint.startswith("tcp://[")


# ------------------------------------------------------------------ CurveZMQ encryption


def curve_available() -> bool:
    return bool(zmq.has("curve"))


ENCRYPTED_STORE = b"ctrlcomm-store"  # (the derivation of an encrypted store's key pair)


def store_curve_keys(key: bytes, person: bytes = ENCRYPTED_STORE) -> tuple[bytes, bytes]:
    """The store's CurveZMQ key pair (public, secret; Z85), derived from the group's shared
    key: every client can then check it talks to the real store, and nothing but the shared
    key has to be distributed. ``person`` tells apart the pairs of an encrypted store
    (``encrypt=True``) and a keyed one (:data:`KEYED_STORE`)."""
    seed = hashlib.blake2b(key, person=person, digest_size=32).digest()
    secret = zmq.utils.z85.encode(seed)
    return zmq.curve_public(secret), secret


# With a key and without encryption, a store's ZeroMQ socket still runs CurveZMQ's handshake,
# with a key pair derived from the key: the server's public key is never sent, so a peer
# without the key cannot complete the handshake and ZeroMQ takes nothing from it. Without,
# anyone who reaches the port could make ZeroMQ buffer a message whole before ctrlcomm sees
# it: one of millions of empty frames grew the process by 32 times what was sent, and taking
# it apart stalled the store for 37 s. (Its traffic is then encrypted too, as a side effect;
# the key pair differs from an encrypted store's, so a client that encrypts and a store that
# does not still do not talk.) A group's sockets with transport="zmq" are left as they are
# (README, Security): a group's traffic can be large, and encrypt=True is there for it.
KEYED_STORE = b"ctrlcomm-sauth"


# The handshakes a store counts as failed: a peer that speaks another mechanism (no key), or
# whose CurveZMQ boxes do not open (another key). Not those cut short (no detail: a port
# scan, a client gone mid-handshake).
HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


def _monitor(sock: zmq.Socket[Any], events: int) -> zmq.Socket[Any] | None:
    """A monitor of ``events`` on ``sock`` (at an address of this process's own: pyzmq's
    default names it by descriptor, which a socket closed just before may still hold), or
    None where ZeroMQ cannot make one (out of descriptors, say): then nothing is counted."""
    try:
        return sock.get_monitor_socket(
            events, addr=f"inproc://ctrlcomm-monitor-{next(_store_ids)}-{os.getpid()}")
    except zmq.ZMQError:
        return None


def _close_monitor(sock: zmq.Socket[Any], monitor: zmq.Socket[Any] | None) -> None:
    if monitor is not None:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        monitor.close(0)


def _handshakes_failed(monitor: zmq.Socket[Any]) -> int:
    """How many failed handshakes a socket's monitor reports now (its events read)."""
    n = 0
    for _ in range(1000):
        try:
            frames = monitor.recv_multipart(zmq.DONTWAIT)
        except zmq.Again:
            break
        n += len(frames) == 2  # (an event: its number and value, then the address)
    return n


def _store_curve(key: bytes | None, encrypt: bool) -> bytes | None:
    """The derivation (``person`` of :func:`store_curve_keys`) of the CurveZMQ key pair a
    store's socket with this ``key`` runs with: the encrypted store's where ``encrypt``,
    :data:`KEYED_STORE` where only keyed (and CurveZMQ is there: pyzmq's wheels have it),
    None for none."""
    if encrypt:
        return ENCRYPTED_STORE
    return KEYED_STORE if key and curve_available() else None


def _curve_client(sock: zmq.Socket[Any], server_public: bytes) -> None:
    public, secret = zmq.curve_keypair()
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


def _curve_server(sock: zmq.Socket[Any], secret: bytes) -> None:
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


def _bind_error(e: zmq.ZMQError, what: str, addr: str) -> CtrlcommError:
    if e.errno == zmq.EADDRINUSE:
        hint = ("; if it is another group's store (torch's new_group reuses its world's "
                "port), a group formed through it passes host_store=False, or give this "
                "group a port of its own") if what == "store" else ""
        return StoreError(f"cannot bind {what} on {addr}: address already in use{hint}")
    return StoreError(f"cannot bind {what} on {addr}: {e}")


def _refused(address: str, timeout: float) -> bool:
    """Whether a TCP connection to the ZeroMQ endpoint ``address`` ("tcp://host:port") is
    refused: nothing listens there (its socket closed). Not where it is taken (the peer is
    there: one that closes at once, before ZeroMQ's greeting, which ZeroMQ drops), nor where
    it cannot tell (no answer within ``timeout``, no route)."""
    try:
        with socket.create_connection(_parse_tcp(address)[1], timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False
_store_ids = itertools.count()
# the longest a poll may sleep: ZeroMQ takes milliseconds as a C int (a longer wait, of
# a request with an hours-long deadline, sleeps again)
MAX_POLL_MS = 3_600_000
MAX_POLL_S = MAX_POLL_MS / 1000


# How long StoreServer waits for the lookup of a host name it is to bind (by default).
BIND_LOOKUP_S = 30.0


def _bind_host(host: str, port: int, timeout: float) -> str:
    """What ZeroMQ is given to bind for ``host``: an address, ``*`` or an interface's name
    (``eth0``) as they are; a host name looked up here, within ``timeout`` seconds (ZeroMQ
    would look it up itself, without a deadline: see :func:`resolve`)."""
    if not isinstance(host, str) or not host:
        raise StoreError(f"cannot bind store: host must be a non-empty str, got {host!r}")
    if host.startswith("[") and host.endswith("]") and _numeric(host[1:-1]):
        return host[1:-1]  # ([::1], as a URL writes it)
    if host == "*" or _numeric(host) or host in {n for _, n in socket.if_nameindex()}:
        return host
    try:
        return resolve(host, timeout)
    except TimeoutError as e:
        raise StoreTimeoutError(f"cannot bind store on {host}:{port}: {e}",
                                answered=False) from None
    except (OSError, UnicodeError) as e:
        raise StoreError(f"cannot bind store on {host}:{port}: {host!r} is not an address, "
                         f"an interface of this host or a name that resolves ({e})") from None


def auth_key_or_env(given: str | bytes | None = None) -> bytes | None:
    """The key a group or a store takes: ``given``, else ``CTRLCOMM_AUTH_KEY`` from the
    environment (empty there is unset, as shells have it); as bytes, None for none. (One
    place for the fallback every entry point has: Group.create, from_env under torchrun,
    group_from_torch, vLLM's dataclass, the store command, the bench, run_group.)"""
    key = given if given is not None else (os.environ.get("CTRLCOMM_AUTH_KEY") or None)
    return key.encode() if isinstance(key, str) else key


_warned_unkeyed = False

UNKEYED_WARNING = (
    "%s binds %s, which other hosts can reach, without an auth_key. What the default "
    "protects: nobody who did not join a group can make its ranks unpickle anything or "
    "change a result (every message and heartbeat is authenticated with a secret rank 0 "
    "makes at formation, which the store gives only to the ranks that joined), and the "
    "store's limits bound what strangers make it hold. What it does not: one who reads "
    "the network while a group forms learns that secret, and anyone who reaches the store "
    "can join a forming group in a rank's place before that rank comes (the rank is then "
    "told it joined already). Give every rank and store the same auth_key (or set "
    "CTRLCOMM_AUTH_KEY) for those, and encrypt=True to hide what is sent. (Said once.)")


def warn_if_unkeyed(what: str, address: str, key: bytes | None) -> None:
    """Log, once per process, what a socket bound without a key beyond the loopback
    (``address``: a numeric address, ``*``, or an interface's name) protects, and what
    not."""
    global _warned_unkeyed
    if key or _warned_unkeyed:
        return
    host = address.strip("[]")
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        if host == "lo":
            return
    _warned_unkeyed = True
    log.warning(UNKEYED_WARNING, what, address)


def _poll_ms(deadline: float | None) -> int | None:
    """A poll's timeout, in ms, for a wait until ``deadline`` (None: no deadline)."""
    if deadline is None:
        return None
    return min(max(0, int((deadline - time.monotonic()) * 1000) + 1), MAX_POLL_MS)


def _keepalive(s: socket.socket) -> None:
    """TCP keepalives on a store's connection: one whose client is gone without a word (a
    host that went down) ends within about 25 s, not TCP's 2 hours (its client, back,
    reconnects under its id, which a connection still open would keep)."""
    with contextlib.suppress(OSError, AttributeError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


def _interface_address(name: str) -> str:
    """The IPv4 address of the interface ``name`` (what ZeroMQ binds for an interface's
    name)."""
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            got = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                              struct.pack("256s", name.encode()[:15]))
        except OSError as e:
            raise StoreError(f"cannot bind the store on interface {name!r}: it has no IPv4 "
                             f"address ({e.strerror or e})") from None
    return socket.inet_ntoa(got[20:24])


def _bind_os_error(e: OSError, what: str, addr: str) -> CtrlcommError:
    if e.errno == errno.EADDRINUSE:
        return _bind_error(zmq.ZMQError(zmq.EADDRINUSE), what, addr)
    return CtrlcommError(f"cannot bind {what} on {addr}: {e.strerror or e}")


# ------------------------------------------------------------------------------- TCP


def _parse_tcp(endpoint: str) -> tuple[int, tuple[str, int]]:
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"not a tcp endpoint: {endpoint!r}")
    hostport = endpoint[6:]
    host, _, port = hostport.rpartition(":")
    if host.startswith("["):
        return socket.AF_INET6, (host[1:-1], int(port))
    return socket.AF_INET, (host, int(port))


def host_id() -> str:
    """Who can reach this process's abstract Unix sockets and is let in: the same kernel
    (boot id), the same network namespace (they are scoped to it) and the same user (others
    are refused: see :func:`_same_user`). Empty where there are none (not Linux)."""
    global _host_id
    if _host_id is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
            netns = os.stat("/proc/self/ns/net").st_ino
            _host_id = hashlib.blake2b(f"{boot}/{netns}/{os.getuid()}".encode(),
                                       digest_size=8).hexdigest()
        except OSError:
            _host_id = ""
    return _host_id


_host_id: str | None = None


def ipc_id() -> str:
    """This process's IPC namespace, where it has one to name (``transport="shm"``: ranks
    of one host share memory within one, as a user of the host would expect)."""
    try:
        return str(os.stat("/proc/self/ns/ipc").st_ino)
    except OSError:
        return ""


def _proc_stat(path: str) -> list[bytes]:
    """The fields of a ``/proc/.../stat`` file after the command name: state first, then
    ppid..., the start time at index 19 (raises OSError, ValueError)."""
    with open(path, "rb") as f:
        st = f.read()
    return st[st.rindex(b")") + 2:].split()


def proc_address() -> str:
    """This process as same-host peers can look it up in ``/proc``:
    ``proc:HOST:PID:START``, where HOST names the kernel, network and PID namespace and user
    (``host_id`` and the PID namespace: there a pid means this process) and START is its
    start time, which a later process reusing the pid does not share. Empty where there is
    no ``/proc``."""
    hid = host_id()
    if not hid:
        return ""
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
        start = int(_proc_stat("/proc/self/stat")[19])
    except (OSError, ValueError, IndexError):
        return ""
    key = hashlib.blake2b(f"{hid}/{pidns}".encode(), digest_size=8).hexdigest()
    return f"proc:{key}:{os.getpid()}:{start}"


def same_host_procs(addresses: dict[int, str], mine: str) -> dict[int, tuple[int, int]]:
    """``{rank: (pid, start time)}`` of the peers whose :func:`proc_address` (``addresses``:
    ``{rank: "proc:..."}``) says they are processes this one (``mine``: the one it
    published) can look up in ``/proc``."""
    if not mine:
        return {}
    key = mine.split(":")[1]
    out = {}
    for r, a in addresses.items():
        parts = a.split(":")
        if len(parts) == 4 and parts[0] == "proc" and parts[1] == key and a != mine:
            try:
                out[r] = (int(parts[2]), int(parts[3]))
            except ValueError:
                continue
    return out


def proc_runs(pid: int, start: int) -> bool:
    """Whether the process of this host with ``pid`` and start time ``start`` (as
    :func:`same_host_procs` gives them) still runs: not exited, not a zombie, its pid not
    taken by another since."""
    try:
        fields = _proc_stat(f"/proc/{pid}/stat")
        return int(fields[19]) == start and fields[0] not in (b"Z", b"X")
    except (OSError, ValueError, IndexError):
        return False


def _local_mode() -> str:
    """``CTRLCOMM_LOCAL_SOCKETS``: "auto" (default), "1" (always) or "0" (never)."""
    mode = os.environ.get("CTRLCOMM_LOCAL_SOCKETS", "auto").strip().lower()
    return mode if mode in ("0", "1") else "auto"


def _cpus() -> int:
    """CPUs this process may use: its affinity, capped by a cgroup (v2) CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return n


def use_local_sockets(local_ranks: int, cpus: int) -> bool:
    """Whether ``local_ranks`` ranks of a group on one host with ``cpus`` CPUs should talk
    over Unix sockets ("auto"). A Unix send costs less CPU than a loopback TCP one, but wakes
    the receiver with a hint to run it on the sender's CPU: with a CPU free for each rank
    that serialises them (world 2 on 2 cores: latency up 15-20 %), when ranks outnumber the
    CPUs it does not matter and the cheaper sends win (worlds 4 and 8 on 2 cores: 5-15 %
    faster). Measured with ``ctrlcomm bench``; see benchmarks/README.md."""
    return local_ranks > cpus
