"""The store's client API, :class:`StoreClient` (torch's ``Store`` verbs), and the checks of
its arguments."""

from __future__ import annotations

import itertools
import operator
import threading
import time
from collections.abc import Sequence
from typing import Any

from .. import _wire as w
from .._errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    StoreError,
    StoreKeyError,
    StoreQueueEmptyError,
    StoreTimeoutError,
    show,
)
from ._state import _I64_MAX, _I64_MIN, _KEY_LEN, MAX_KEY, MAX_VALUE


def _b(x: str | bytes) -> bytes:
    """A key or value as bytes: str (UTF-8), or bytes-like. Anything else is refused, as
    TCPStore does (bytes(n) of an int n would be n zero bytes)."""
    if isinstance(x, str):
        return x.encode()
    if isinstance(x, (bytes, bytearray, memoryview)):
        return bytes(x)
    raise ArgumentTypeError(f"store: a key or value must be str or bytes, not "
                            f"{type(x).__name__}")


def _secs(timeout: Any) -> float:
    """Seconds, from a number or a timedelta (torch's store methods take either; not from
    a str, which float() would read)."""
    if isinstance(timeout, (str, bytes)):
        raise InvalidArgumentError(f"store: timeout {timeout!r} is not a number of seconds "
                                   "or a timedelta")
    if hasattr(timeout, "total_seconds"):
        return float(timeout.total_seconds())
    try:
        return float(timeout)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"store: timeout {timeout!r} is not a number of seconds "
                                   "or a timedelta") from None


# the longest timeout a store call takes (longer ones are this: 30 years)
MAX_TIMEOUT_S = 1e9


def _timeout(timeout: Any, op: str) -> float:
    """A store call's timeout, in seconds (a number or a timedelta), > 0."""
    t = _secs(timeout)
    if not t > 0:  # (NaN too)
        raise InvalidArgumentError(f"store {op}: timeout must be > 0 seconds, got "
                                   f"{show(timeout)}")
    return min(t, MAX_TIMEOUT_S)


def port_arg(port: Any, what: str = "port") -> int:
    """``port``, checked: an int in 1..65535 (InvalidArgumentError naming ``what``)."""
    try:
        port = operator.index(port)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be an int, got {show(port)}") from None
    if not 0 < port < 65536:
        raise InvalidArgumentError(f"{what} must be in 1..65535, got {port}")
    return int(port)


def _key_list(keys: Any, op: str) -> Sequence[str | bytes]:
    """``keys``, a list of keys (one str would be taken as its characters), as TCPStore."""
    if isinstance(keys, (str, bytes, bytearray, memoryview)):
        raise ArgumentTypeError(f"store {op}: keys must be a list of keys, got one "
                                f"{type(keys).__name__} ({show(keys)}): pass [{show(keys)}]")
    return keys  # type: ignore[no-any-return]


# A get or wait of timeout t lets the store wait t for the keys (as TCPStore's do), and its
# reply (a timeout naming the keys still missing) this much longer to come back.
REPLY_SLACK_S = 1.0


def _check_host(host: Any, what: str) -> str:
    """``host``, a str (an IPv6 address in brackets, as in a URL, without them)."""
    if not isinstance(host, str) or not host.strip("[]"):
        raise InvalidArgumentError(f"{what} must be a host name or address (a str), got "
                                   f"{show(host)}")
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _store_host(host: Any, port: Any, timeout: float) -> str:
    """The store's address: ``host`` checked, a name looked up within ``timeout`` seconds.
    Raises StoreError where it does not resolve, StoreTimeoutError where the lookup took
    longer (see _transport.resolve)."""
    from ..transport._net import resolve

    host = _check_host(host, "host")
    try:
        return resolve(host, timeout)
    except TimeoutError as e:
        raise StoreTimeoutError(f"cannot reach the store at {host}:{port}: {e}",
                                answered=False) from None
    except (OSError, UnicodeError) as e:  # (socket.gaierror; OSError for EAI_SYSTEM)
        raise StoreError(f"cannot reach the store at {host}:{port}: host {host!r} does not "
                         f"resolve ({getattr(e, 'strerror', None) or e})") from None


class StoreClient:
    """Client of a ctrlcomm store at ``(host, port)``. Every call has a deadline.

    Keys are ``str`` (or bytes); values are ``bytes`` (``str`` is encoded as UTF-8), as with
    torch's ``TCPStore``, whose method names are also accepted (``delete_key``, ``check``,
    ``compare_set``, ``wait``). A client may be shared by threads (calls are serialized).

    Args:
        host: the store's address.
        port: the store's port.
        timeout: default deadline in seconds of every call.
        prefix: prepended to every key (namespacing).
        auth_key: the store's key: requests and replies then carry a MAC (a store with a key
            answers nothing else, and this client accepts no unauthenticated reply).
    """

    def __init__(self, host: str, port: int, *, timeout: float = 300.0, prefix: str = "",
                 auth_key: bytes | str | None = None, encrypt: bool = False,
                 _address: str | None = None) -> None:
        from ._conn import store_connection

        _check_host(host, "store: host")
        self.host, self.port, self.prefix = host, port_arg(port, "store: port"), prefix
        self.timeout = _timeout(timeout, "client")
        key = auth_key.encode() if isinstance(auth_key, str) else auth_key
        if encrypt and not key:
            raise InvalidArgumentError("an encrypted store connection needs an auth_key")
        self.encrypt = encrypt
        # a name is looked up here, within the timeout (see _transport.resolve), and ZeroMQ
        # given the number: it would look the name up without a deadline, at every
        # reconnection too (_address: ``host``'s, looked up by the caller already; ``host``
        # is named in errors)
        address = _address or _store_host(host, self.port, self.timeout)
        self._conn = store_connection(address, self.port, key or None, encrypt)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # (held by the call in progress)
        # _closed and _busy (a call is in progress), changed together under _state: close()
        # closes the connection itself where no call is in progress, else wakes the call,
        # which closes it as it ends
        self._state = threading.Lock()
        self._closed = self._busy = False

    def __repr__(self) -> str:
        return f"StoreClient({self.host!r}, {self.port}, prefix={self.prefix!r})"

    @property
    def keyed(self) -> bool:
        """Whether this client signs its requests (an auth_key)."""
        return bool(self._conn.key)

    def _k(self, key: str | bytes) -> bytes:
        return _b(self.prefix) + _b(key)

    def _call(self, op: int, keys: Sequence[bytes], values: Sequence[bytes] = (),
              timeout: float | None = None, wait: float = 0.0) -> w.StoreReply:
        t = self.timeout if timeout is None else _timeout(timeout, w.STORE_OP_NAME.get(op, "call"))
        # (over the limits the store's socket would drop the connection: said here, at once)
        for what, parts, most in (("key", keys, MAX_KEY), ("value", values, MAX_VALUE)):
            for v in parts:
                if len(v) > most:
                    raise InvalidArgumentError(f"store: a {what} of {len(v)} bytes is over "
                                               f"the store's limit of {most} bytes")
        # (a wait beyond the wire's limit, decades, would be dropped as malformed)
        wait = min(wait, w.STORE_MAX_WAIT_S / 2)
        with self._lock:
            try:  # (the flag set inside: whatever interrupts the call, it is cleared)
                with self._state:
                    if self._closed:
                        raise StoreError(f"the store client of {self.host}:{self.port} is "
                                         "closed")
                    self._busy = True
                req = w.StoreRequest(op, next(self._ids) & 0xFFFFFFFF, wait, tuple(keys),
                                     tuple(values))
                rep = self._conn.request(req, deadline=time.monotonic() + t)
            finally:
                with self._state:
                    self._busy = False
                    closed = self._closed
                if closed:  # by another thread, while this request waited: it woke it
                    self._conn.close()
        if rep is None:
            hint = (" (with encryption on, a store that runs without it, or with another "
                    "key, never answers)") if self.encrypt else \
                (" (a store with another auth_key, or none, answers nothing a key signs: "
                 "every rank and the store need the same one)") if self._conn.key else \
                " (is it running? one run with an auth_key answers nothing unsigned)"
            raise StoreTimeoutError(
                f"store at {self.host}:{self.port} did not answer within {t:.1f} s{hint}",
                answered=False)
        if rep.status == w.R_ERROR:
            raise StoreError(f"store at {self.host}:{self.port} refused the request: "
                             f"{rep.values[0].decode(errors='replace') if rep.values else ''}")
        return rep

    def set(self, key: str | bytes, value: str | bytes, *, timeout: float | None = None) -> None:
        self._call(w.S_SET, [self._k(key)], [_b(value)], timeout)

    def get(self, key: str | bytes, *, wait: bool = True, timeout: float | None = None) -> bytes:
        """The value of ``key``; waits up to ``timeout`` for it to be set unless ``wait=False``."""
        return self.multi_get([key], wait=wait, timeout=timeout)[0]

    def multi_get(self, keys: Sequence[str | bytes], *, wait: bool = True,
                  timeout: float | None = None) -> list[bytes]:
        t = self.timeout if timeout is None else _timeout(timeout, "get")
        keys = _key_list(keys, "multi_get")
        rep = self._call(w.S_GET, [self._k(k) for k in keys], (), t + REPLY_SLACK_S,
                         t if wait else 0.0)
        if rep.status == w.R_TIMEOUT:
            missing = [m.decode(errors="replace")[len(self.prefix):] for m in rep.values]
            if not wait:
                raise StoreKeyError(missing[0] if len(missing) == 1 else missing)
            raise StoreTimeoutError(f"store at {self.host}:{self.port}: get timed out after "
                                    f"{t:g} s; missing keys {missing}")
        return list(rep.values)

    def wait(self, keys: Sequence[str | bytes], timeout: float | None = None) -> None:
        """Wait until every key exists. Raises :class:`StoreTimeoutError` naming the missing."""
        t = self.timeout if timeout is None else _timeout(timeout, "wait")  # (or a timedelta)
        keys = _key_list(keys, "wait")
        rep = self._call(w.S_WAIT, [self._k(k) for k in keys], (), t + REPLY_SLACK_S, t)
        if rep.status == w.R_TIMEOUT:
            missing = [m.decode(errors="replace")[len(self.prefix):] for m in rep.values]
            raise StoreTimeoutError(f"store at {self.host}:{self.port}: wait timed out after "
                                    f"{t:g} s; missing keys {missing}")

    def set_timeout(self, timeout: Any) -> None:
        """The default deadline of every call, in seconds or as a timedelta (TCPStore's)."""
        self.timeout = _timeout(timeout, "set_timeout")

    def multi_set(self, keys: Sequence[str | bytes], values: Sequence[str | bytes], *,
                  timeout: float | None = None) -> None:
        """Set each key to its value (TCPStore's; one after the other, not at once)."""
        if len(keys) != len(values):
            raise InvalidArgumentError(f"multi_set: {len(keys)} keys and {len(values)} values")
        for k, v in zip(keys, values, strict=True):
            self.set(k, v, timeout=timeout)

    def append(self, key: str | bytes, value: str | bytes, *,
               timeout: float | None = None) -> None:
        """Append ``value`` to ``key``'s value (set it if absent), atomically (TCPStore's)."""
        add = _b(value)
        try:
            cur: bytes | None = self.get(key, wait=False, timeout=timeout)
        except KeyError:
            cur = None
        while True:
            absent = cur is None
            rep = self._call(w.S_CAS, [self._k(key)],
                             [b"1" if absent else b"0", cur or b"", (cur or b"") + add], timeout)
            if rep.status == w.R_OK:
                return
            # changed meanwhile (or deleted): again from what it holds now (no value: absent)
            cur = rep.values[0] if rep.values else None

    def add(self, key: str | bytes, amount: int, *, timeout: float | None = None) -> int:
        """Add ``amount`` to the 64-bit integer ``key`` holds (0 if absent), wrapping as
        TCPStore's add does; returns the new value."""
        try:  # (an int, as TCPStore's: 1.5 or "7" are refused, not cut or parsed)
            n = operator.index(amount)
        except TypeError:
            raise ArgumentTypeError(f"store add of {key!r}: the amount must be an int, got "
                                    f"a {type(amount).__name__} ({show(amount)})") from None
        if not _I64_MIN <= n <= _I64_MAX:
            raise InvalidArgumentError(f"store add of {key!r}: the amount must be a 64-bit "
                                       f"integer, got one of {n.bit_length()} bits")
        return int(self._call(w.S_ADD, [self._k(key)], [str(n).encode()], timeout).values[0])

    def compare_set(self, key: str | bytes, expected: str | bytes | None, desired: str | bytes, *,
                    timeout: float | None = None) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``None`` or ``""``: if absent).

        Returns what ``TCPStore.compare_set`` returns: the value the key holds afterwards,
        or, where it is absent and stays so (``expected`` given and not empty), ``expected``.
        """
        absent = expected is None
        rep = self._call(w.S_CAS, [self._k(key)],
                         [b"1" if absent else b"0", b"" if absent else _b(expected or b""), _b(desired)],
                         timeout)
        if rep.values:
            return rep.values[0]
        return _b(expected) if expected else b""

    def set_if_absent(self, key: str | bytes, value: str | bytes, *,
                      timeout: float | None = None) -> tuple[bool, bytes]:
        """Atomically set ``key`` unless it exists: (whether it was set, value it holds)."""
        rep = self._call(w.S_CAS, [self._k(key)], [b"1", b"", _b(value)], timeout)
        return rep.status == w.R_OK, (rep.values[0] if rep.values else b"")

    def delete(self, key: str | bytes, *, timeout: float | None = None) -> bool:
        return int(self._call(w.S_DELETE, [self._k(key)], (), timeout).values[0]) > 0

    delete_key = delete

    def multi_delete(self, keys: Sequence[str | bytes], *, timeout: float | None = None) -> int:
        """Delete each of ``keys`` (in one request); returns how many existed."""
        keys = _key_list(keys, "multi_delete")
        return int(self._call(w.S_DELETE, [self._k(k) for k in keys], (), timeout).values[0])

    def delete_prefix(self, prefix: str | bytes, *, timeout: float | None = None) -> int:
        return int(self._call(w.S_DELETE_PREFIX, [self._k(prefix)], (), timeout).values[0])

    def check(self, keys: Sequence[str | bytes], *, timeout: float | None = None) -> bool:
        """Whether every key exists (no waiting)."""
        return all(self.exists(_key_list(keys, "check"), timeout=timeout))

    def exists(self, keys: Sequence[str | bytes], *, timeout: float | None = None) -> list[bool]:
        keys = _key_list(keys, "exists")
        rep = self._call(w.S_CHECK, [self._k(k) for k in keys], (), timeout)
        return [v == b"1" for v in rep.values]

    def ping(self, *, timeout: float | None = None) -> None:
        self._call(w.S_PING, [], (), timeout)

    def num_keys(self, *, timeout: float | None = None) -> int:
        """How many keys the store holds, every client's (TCPStore's; as with its
        PrefixStore, a client's ``prefix`` does not narrow the count). A group's formation
        keeps a few keys of its own there."""
        return int(self._call(w.S_NUM_KEYS, [], (), timeout).values[0])

    def list_keys(self, *, timeout: float | None = None) -> list[str]:
        """The keys the store holds under this client's ``prefix``, without it (TCPStore's;
        in no particular order)."""
        prefix = _b(self.prefix)
        rep = self._call(w.S_LIST_KEYS, [prefix], (), timeout)
        data, out, at, cut = rep.values[0], [], 0, len(prefix)
        while at < len(data):
            (n,) = _KEY_LEN.unpack_from(data, at)
            at += _KEY_LEN.size
            out.append(data[at + cut:at + n].decode(errors="replace"))
            at += n
        return out

    def queue_push(self, key: str | bytes, value: str | bytes, *,
                   timeout: float | None = None) -> None:
        """Append ``value`` to the queue ``key`` (TCPStore's). Queues are apart from the
        keys (a key and a queue may share a name; ``num_keys``, ``list_keys`` and
        ``delete_key`` do not see queues), but, as in TCPStore, ``check`` and ``wait`` see
        a queue that holds values, and ``get`` of a name that is only such a queue gives
        ``b""``."""
        self._call(w.S_QUEUE_PUSH, [self._k(key)], [_b(value)], timeout)

    def queue_pop(self, key: str | bytes, block: bool = True, *,
                  timeout: float | None = None) -> bytes:
        """Take the first value of the queue ``key`` (TCPStore's). Where it is empty: with
        ``block``, waits up to ``timeout`` for a push, then raises
        :class:`StoreTimeoutError`; without, raises :class:`StoreQueueEmptyError` at once.
        (Each value goes to one pop. A push wakes the pops that wait, which pop again: the
        value stays queued until one takes it, never handed to a pop whose caller has gone
        or given up.)"""
        t = self.timeout if timeout is None else _timeout(timeout, "queue_pop")
        k, deadline = self._k(key), time.monotonic() + t
        while True:
            wait = max(deadline - time.monotonic(), 0.0) if block else 0.0
            rep = self._call(w.S_QUEUE_POP, [k], (), wait + REPLY_SLACK_S, wait)
            if rep.status == w.R_TIMEOUT:
                if not block:
                    raise StoreQueueEmptyError(f"store at {self.host}:{self.port}: queue "
                                               f"{key!r} is empty")
                raise StoreTimeoutError(f"store at {self.host}:{self.port}: queue_pop of "
                                        f"{key!r} timed out after {t:g} s (nothing was pushed)")
            if rep.values:
                return rep.values[0]
            # (woken by a push: another pop may have taken it first; looks again)

    def queue_len(self, key: str | bytes, *, timeout: float | None = None) -> int:
        """How many values the queue ``key`` holds (TCPStore's; 0 for one never pushed to)."""
        return int(self._call(w.S_QUEUE_LEN, [self._k(key)], (), timeout).values[0])

    def close(self) -> None:
        """Close the connection; a call waiting in another thread raises StoreError (never
        blocks: that call closes it as it ends)."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            busy = self._busy
        if busy:
            self._conn.interrupt()
        else:
            self._conn.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
