"""vLLM's ``StatelessProcessGroup`` API on the ctrlcomm core.

Same names, signatures and observable semantics as ``vllm.distributed.utils``, with the
original's weak points fixed: the data plane is direct sockets (not a TCPStore), so two ranks
sending to one destination never overwrite each other, nothing piles up in a store (memory
stays flat however many broadcasts run; :meth:`expire_data` has nothing left to do), every
wait has a deadline, and a dead peer is an error naming it.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import socket as _socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from . import _dropin as di
from ._dropin import Group, StoreClient, StoreServer
from ._errors import ConcurrentUseError, InvalidArgumentError, show

_TENSOR_TAG = 1 << 40  # point-to-point tensors travel apart from send_obj/recv_obj objects
# broadcast_obj's messages: one ordered stream per source, as the original's store keys
# "broadcast_from/{src}/{n}" are (see broadcast_obj)
_BCAST_TAG = (1 << 40) + 1
_TAGS = (0, _TENSOR_TAG)  # the tag of each stream _send and _recv take (objects, tensors)


def _torch_op(op: Any, rank: int) -> str:
    import torch.distributed as dist

    R = dist.ReduceOp
    for name, value in (("sum", R.SUM), ("prod", R.PRODUCT), ("max", R.MAX), ("min", R.MIN)):
        if op == value or (isinstance(op, str) and op.lower() in (name, str(value).lower())):
            return name
    raise InvalidArgumentError(f"all_reduce on rank {rank}: op {show(op)} is not supported; "
                               "use ReduceOp.SUM, PRODUCT, MAX or MIN")


def _copy_into(tensor: Any, data: Any) -> None:
    """Copy in place, as torch.distributed's collectives do: also into a tensor that
    requires grad (a parameter, whose weights a trainer broadcasts), without autograd."""
    import torch

    with torch.no_grad():
        tensor.copy_(data)


def _compact(tensor: Any) -> Any:
    """``tensor`` on the CPU, holding only its own elements: a view (a slice of a weight
    buffer, say) pickles with its whole storage, and torch.distributed's tensor calls move
    ``numel()`` elements."""
    import torch

    t = tensor.detach().cpu()
    if t.storage_offset() or not t.is_contiguous() \
            or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _on_device_of(got: Any, like: Any) -> Any:
    device = getattr(like, "device", None)
    return got if device is None or got.device == device else got.to(device)


_F = TypeVar("_F", bound=Callable[..., Any])


def _one_at_a_time(method: _F) -> _F:
    """vLLM's group takes calls from several threads, one at a time (its TCPStore client
    makes one request at a time): so does this one, where a :class:`Group` raises
    :class:`ConcurrentUseError`. A call waits for the one in progress for at most its own
    timeout (``barrier``'s, else the group's); then it raises ConcurrentUseError naming that
    call. (A call that waits for a peer holds the group, as the original's ``get`` holds its
    client: another thread's call in the meantime waits.)"""
    op = method.__name__
    sig = inspect.signature(method)

    @functools.wraps(method)
    def call(self: StatelessProcessGroup, *args: Any, **kwargs: Any) -> Any:
        lock = self._lock
        if not lock.acquire(False):
            t = None
            if "timeout" in sig.parameters:  # (barrier's: given, or its default)
                try:
                    bound = sig.bind(self, *args, **kwargs)
                    bound.apply_defaults()
                    t = bound.arguments["timeout"]
                except TypeError:  # (the call itself says what is wrong)
                    pass
            if not (isinstance(t, (int, float)) and t > 0):  # (else the call says what's wrong)
                t = di.default_timeout(self._group)
            if not lock.acquire(timeout=min(t, threading.TIMEOUT_MAX)):
                raise ConcurrentUseError(
                    f"{op} on rank {self.rank}: another thread's {self._holder} held the "
                    f"group for all of this call's {t:g} s timeout")
        held, self._holder = self._holder, op
        try:
            return method(self, *args, **kwargs)
        finally:
            self._holder = held
            lock.release()

    return call  # type: ignore[return-value]


# the class ctrlcomm.vllm.install() derived from this one and vLLM's (None before): what
# this class's constructor makes, so that a group made by either name passes vLLM's checks
_installed: list[type] = []


def install_class(cls: type) -> None:
    _installed[:] = [cls]


def installed_class() -> type | None:
    return _installed[0] if _installed else None


class StatelessProcessGroup:
    """A group made without torch.distributed's global state (vLLM's API).

    Attributes:
        rank: this process's rank.
        world_size: number of ranks.
        store: the rendezvous store client (``set``, ``get``, ``add``, ``delete_key``...).
        data_expiration_seconds: kept for compatibility; no data is kept to expire.
    """

    WRAPS_A_GROUP = True  # (ctrlcomm.torch.init_torch_process_group takes its group)

    def __new__(cls, *args: Any, **kwargs: Any) -> StatelessProcessGroup:
        if cls is StatelessProcessGroup and _installed:
            cls = _installed[0]
        return object.__new__(cls)

    def __init__(self, group: Group | int | None = None, world_size: int | None = None,
                 store: Any = None,
                 socket: _socket.socket | None = None, data_expiration_seconds: int = 3600,
                 *, rank: int | None = None, server: StoreServer | None = None) -> None:
        """Wrap a formed ctrlcomm ``group``; or, as vLLM's dataclass is made,
        ``StatelessProcessGroup(rank, world_size, store)`` (keywords too): the group is
        formed through ``store``, a store of torch's (``TCPStore``) or ctrlcomm's client
        that every rank reaches (rank 0 serves ctrlcomm's rendezvous on a free port and
        publishes its address there), within the store's timeout; ``store`` stays the
        attribute of that name, as on vLLM's dataclass. With ``store=None`` (a
        stand-in, as tests make one) the object holds ``rank`` and ``world_size`` and its
        calls raise :class:`InvalidArgumentError`."""
        if not isinstance(group, Group):
            if rank is not None and group is not None:
                raise InvalidArgumentError("StatelessProcessGroup: rank given twice")
            if world_size is None or (rank is None and group is None):
                raise InvalidArgumentError("StatelessProcessGroup needs a formed ctrlcomm "
                                           "group, or rank and world_size (and a store)")
            formed: Group = self._formed(group if rank is None else rank, world_size, store)
        elif world_size is not None or store is not None or rank is not None:
            raise InvalidArgumentError("StatelessProcessGroup(group): a formed group holds "
                                       "its rank, world size and store")
        else:
            formed = group
        self._group = formed
        # (calls from several threads take turns: see _one_at_a_time; reentrant, so that a
        # call made under another in this thread, from a signal handler, say, is refused by
        # the group, busy, rather than waiting for itself)
        self._lock = threading.RLock()
        self._holder = ""
        self.rank = formed.rank
        self.world_size = formed.world_size
        # (made through a store of the caller's: that store, as on vLLM's dataclass)
        self._store: Any = formed.store if store is None else store
        self.data_expiration_seconds = data_expiration_seconds
        self.socket = socket
        self._server = server
        # (its group closes itself when collected unclosed; the store served from
        # listen_socket likewise, with the group: `pg.group` may outlive this wrapper)
        self._finalizer = None if server is None else di.close_when_dropped(formed, server.close)

    @property
    def store(self) -> Any:
        """The rendezvous store: a ``torch.distributed.Store`` where torch is installed (a
        :class:`ctrlcomm.torch.TorchStore` over the group's store client, for a group made
        by :meth:`create`), else the :class:`ctrlcomm.StoreClient`; the store given, for a
        group made through one. Assignable, as vLLM's dataclass field is."""
        s = self._store
        if isinstance(s, StoreClient):
            try:
                from .torch import TorchStore
            except ImportError:
                return s
            s = self._store = TorchStore(s)
        return s

    @store.setter
    def store(self, value: Any) -> None:
        self._store = value

    @staticmethod
    def _formed(rank: Any, world_size: Any, store: Any) -> Any:
        """The group of ``StatelessProcessGroup(rank, world_size, store)``: formed through
        ``store``; a :class:`_Unformed` stand-in where it is None."""

        rank, world_size = di.validate_world(rank, world_size)
        if store is None:
            return _Unformed(rank, world_size)
        for need in ("set", "get", "set_timeout", "delete_key"):
            if not callable(getattr(store, need, None)):
                raise InvalidArgumentError(
                    f"StatelessProcessGroup: store must be a torch.distributed Store or a "
                    f"ctrlcomm StoreClient, got a {type(store).__name__} (no {need}())")
        t = di.store_seconds(getattr(store, "timeout", 300.0))
        host = str(getattr(store, "host", "127.0.0.1"))
        port = int(getattr(store, "port", 0))
        g = di.form_through_store(Group, store, "ctrlcomm/stateless", host, port, rank, world_size,
                           {"name": "stateless", "timeout": t}, time.monotonic() + t,
                           f"the store given ({type(store).__name__})")
        if hasattr(store, "set_timeout"):  # (_published shortened it to what was left)
            try:
                store.set_timeout(datetime.timedelta(seconds=t))
            except Exception:  # noqa: BLE001  (best effort)
                pass
        return g

    @staticmethod
    def create(host: str, port: int, rank: int, world_size: int,
               data_expiration_seconds: int = 3600, store_timeout: int = 300,
               listen_socket: _socket.socket | None = None) -> StatelessProcessGroup:
        """A replacement for ``torch.distributed.init_process_group`` without global state.

        Rank 0 serves the rendezvous store on ``(host, port)``, from ``listen_socket`` when
        given (a socket already bound and listening there, which reserves the port early).
        ``store_timeout`` bounds formation and is the default deadline of every call.
        """
        server = None
        if rank == 0 and listen_socket is not None:
            server = StoreServer(host, port, listen_socket=listen_socket,
                                 auth_key=di.auth_key_or_env())
        try:
            g = Group.create(host, port, rank, world_size, name="stateless",
                             timeout=di.store_seconds(store_timeout),
                             host_store=None if server is None else False)
        except BaseException:
            if server is not None:
                server.close()
            raise
        return StatelessProcessGroup(g, data_expiration_seconds=data_expiration_seconds,
                                     server=server, socket=listen_socket)

    # ------------------------------------------------------------------ objects

    @_one_at_a_time
    def send_obj(self, obj: Any, dst: int) -> None:
        """Send an object to ``dst`` (returns at once; ordered per destination; this rank
        itself too, as in vLLM)."""
        self._send(obj, dst, 0, "send_obj", "send_obj(dst={})")

    @_one_at_a_time
    def recv_obj(self, src: int) -> Any:
        """The next object ``src`` sent to this rank."""
        return self._recv(src, 0, "recv_obj", "recv_obj(src={})")

    def _send(self, obj: Any, dst: Any, kind: int, op: str, what: str) -> None:
        """``obj`` to ``dst`` in stream ``kind`` (0: objects, 1: tensors), this rank too;
        ``what``, with the rank, names the call in errors."""
        g = self._group
        dst = di.rank_arg(g, dst, "dst", op)
        if dst == self.rank:
            self._send_self(obj, kind)
        else:
            di.send(g, obj, dst, _TAGS[kind], what.format(dst))

    def _recv(self, src: Any, kind: int, op: str, what: str) -> Any:
        g = self._group
        src = di.rank_arg(g, src, "src", op)
        if src == self.rank:
            return self._recv_self(kind, op)
        return di.recv(g, src, _TAGS[kind], what.format(src))

    @property
    def group(self) -> Group:
        """The :class:`ctrlcomm.Group` underneath (its collectives, ``aio``, ``stats``)."""
        return self._group

    def _send_self(self, obj: Any, kind: int) -> None:
        di.send_self(self._group, obj, _TAGS[kind], f"send to rank {self.rank} (itself)")

    def _recv_self(self, kind: int, op: str) -> Any:
        return di.recv_self(self._group, _TAGS[kind], f"{op}(src={self.rank})")

    @_one_at_a_time
    def broadcast_obj(self, obj: Any | None, src: int) -> Any:
        """``src``'s object, on every rank (the source gets its own object back).

        As in vLLM, each source's broadcasts form one stream of its own: the source returns
        once its object is sent, and the others take ``src``'s broadcasts in the order it
        made them, whatever they do with other sources in between (rank 0 may broadcast and
        then receive rank 1's broadcast while rank 1 does the reverse)."""
        return self._bcast(obj, src, "broadcast_obj")

    def _bcast(self, obj: Any, src: int, op: str) -> Any:
        """``src``'s next object in its stream of broadcasts (broadcast_obj's and the tensor
        broadcast's, one stream per source as the original's store keys are)."""
        g = self._group
        src = di.rank_arg(g, src, "src", op)
        what = f"{op}(src={src})"
        if self.rank != src:
            return di.recv(g, src, _BCAST_TAG, what)
        others = di.others(self.world_size, src)
        if others:
            di.send(g, obj, others, _BCAST_TAG, what)
        else:
            di.check_open(g)
        return obj

    @_one_at_a_time
    def all_gather_obj(self, obj: Any) -> list[Any]:
        """Every rank's object, in rank order."""
        return self._group.all_gather(obj)

    @_one_at_a_time
    def barrier(self, timeout: float = 30.0) -> None:
        """Return once every rank is here; raise ``TimeoutError`` after ``timeout`` s."""
        self._group.barrier(timeout=timeout)

    def expire_data(self) -> None:
        """Nothing to do: ctrlcomm keeps no data behind (kept for API compatibility)."""

    # ------------------------------------------------------------------ tensors

    # As vLLM's: broadcast and all_reduce return a new tensor (on the other ranks, the
    # source's; the one given is left as it is), recv copies into the one given.

    @_one_at_a_time
    def broadcast(self, tensor: Any, src: int) -> Any:
        """``src``'s tensor: the source gets ``tensor`` back; every other rank a new tensor
        (of the source's shape and dtype, on the device of the ``tensor`` it passed, which
        is left as it is). As vLLM's: in the stream of ``src``'s broadcasts, with
        broadcast_obj's (the source returns once it has sent)."""
        payload = _compact(tensor) if self.rank == src else None
        got = self._bcast(payload, src, "broadcast")
        if self.rank == src:
            return tensor
        return _on_device_of(got, tensor)

    @_one_at_a_time
    def send(self, tensor: Any, dst: int) -> None:
        """Send a tensor to ``dst`` (this rank itself too)."""
        self._send(_compact(tensor), dst, 1, "send", "send(tensor, dst={})")

    @_one_at_a_time
    def recv(self, tensor: Any, src: int) -> Any:
        """Receive the next tensor from ``src`` into ``tensor`` (``tensor.copy_``: another
        dtype is cast; as many elements fill it in order whatever the sent shape, as
        torch.distributed's recv does, and fewer are broadcast to its shape where they can
        be); returns ``tensor``."""
        got = self._recv(src, 1, "recv", "recv(tensor, src={})")
        if got.shape != tensor.shape and got.numel() == tensor.numel():
            got = got.reshape(tensor.shape)
        try:
            _copy_into(tensor, got)
        except RuntimeError as e:
            raise InvalidArgumentError(
                f"recv on rank {self.rank}: rank {src} sent a tensor of shape "
                f"{tuple(got.shape)} and dtype {got.dtype}, which does not fit this rank's "
                f"{tuple(tensor.shape)} {tensor.dtype}: {e}") from None
        return tensor

    @_one_at_a_time
    def all_reduce(self, tensor: Any, op: Any = None) -> Any:
        """``tensor`` reduced over all ranks (``ReduceOp.SUM`` by default), as a new tensor
        on ``tensor``'s device; ``tensor`` is left as it is."""
        import torch.distributed as dist

        name = _torch_op(dist.ReduceOp.SUM if op is None else op, self.rank)
        payload = tensor.detach().cpu()
        if payload.data_ptr() == tensor.data_ptr():  # (a CPU tensor: the same memory)
            payload = payload.clone()
        return _on_device_of(self._group.all_reduce(payload, op=name), tensor)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        self._group.close()
        if self._server is not None:
            self._server.close()
            self._server = None

    def __enter__(self) -> StatelessProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ctrlcomm.StatelessProcessGroup rank {self.rank}/{self.world_size}>"


class _Unformed:
    """The group of ``StatelessProcessGroup(rank, world_size, store=None)``: vLLM's dataclass
    made without a store (a stand-in, as tests make one) holds its rank and world size, and
    can send nothing; every call says so. Closing it does nothing."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size, self.store = rank, world_size, None

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        raise InvalidArgumentError(
            f"this StatelessProcessGroup (rank {self.rank} of {self.world_size}) was made "
            "without a store: it has no peers to talk to; make one with "
            "StatelessProcessGroup.create(host, port, rank, world_size), or pass a store")


__all__ = ["StatelessProcessGroup"]
