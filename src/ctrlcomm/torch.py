"""torch interop (``pip install 'ctrlcomm[torch]'``).

- :func:`group_from_torch` (also ``ctrlcomm.Group.from_torch``): a ctrlcomm group with the
  same ranks as a torch process group (any subgroup), formed through that group once.
- :func:`init_torch_process_group`: a real torch ProcessGroup (gloo, or NCCL on GPUs) over the
  ranks of a ctrlcomm group, made without torch.distributed's default group or global state,
  as vLLM's ``stateless_init_torch_distributed_process_group`` does.
- :class:`TorchStore`: a ctrlcomm store client as a ``torch.distributed.Store``, for code
  that wants one (``PrefixStore``, ``init_process_group(store=...)``, C++ consumers).

Small CPU tensors sent through any ctrlcomm collective arrive as tensors (they are pickled).
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

try:
    import torch
    import torch.distributed as dist
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ctrlcomm.torch needs PyTorch: pip install 'ctrlcomm[torch]' "
        "(or install the torch build for your machine first)"
    ) from e

from ._dropin import Group, StoreClient, endpoint_addresses, host_of
from ._errors import (
    InvalidArgumentError,
    StoreError,
    StoreTimeoutError,
)

__all__ = ["TorchStore", "TorchStoreError", "TorchStoreTimeoutError", "group_from_torch",
           "init_torch_process_group"]

log = logging.getLogger("ctrlcomm")


def group_from_torch(process_group: Any = None, *, hostname: str | None = None,
                     name: str = "torch", timeout: float = 300.0, **kwargs: Any) -> Group:
    """A ctrlcomm :class:`~ctrlcomm.Group` over the ranks of a torch process group.

    Collective over ``process_group`` (``None``: the default group): every member must call
    it. The group's first rank (its leader, group rank 0) serves a rendezvous store on
    ``hostname`` (default: see :func:`_default_host`) and broadcasts its address through
    ``process_group``, once; ranks are the group ranks of ``process_group``.

    Args:
        process_group: a torch ProcessGroup, or None for the default group.
        hostname: address the leader's store binds to (reachable by every member);
            ``"0.0.0.0"``: every interface, the members told the default's address.
        name: the ctrlcomm group's name.
        timeout: the ctrlcomm group's default timeout (and formation's deadline).
        **kwargs: passed on to :meth:`ctrlcomm.Group.create` (``transport``, ``codec``...).

    Raises:
        FormationError: on the members other than the leader, where the leader could not
            serve the store (its error is named): they do not wait for torch's timeout.
        CtrlcommError: what :meth:`ctrlcomm.Group.create` raises.
    """
    return Group.from_torch(process_group, hostname=hostname, name=name, timeout=timeout,
                            **kwargs)


def _timedelta(timeout: float | datetime.timedelta) -> datetime.timedelta:
    return timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(
        seconds=float(timeout))


def init_torch_process_group(group: Any, backend: str = "gloo",
                             timeout: float | datetime.timedelta = 1800.0) -> Any:
    """A torch ProcessGroup over the ranks of ``group``, outside torch's global state.

    Rank 0 serves a torch ``TCPStore`` on a free port (only for the backend's own
    rendezvous), whose address travels through ``group``. The result is not registered with
    torch.distributed: ``torch.distributed.is_initialized()`` stays as it was, and several
    such groups can coexist in one process. Use it with ``pg.allreduce([t]).wait()`` or
    ``torch.distributed.all_reduce(t, group=pg)``.

    Args:
        group: the ctrlcomm group whose ranks make the process group (collective over it), or
            a :class:`ctrlcomm.StatelessProcessGroup` (its group is used).
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors).
        timeout: the backend's timeout, in seconds or as a timedelta.
    """
    from torch.distributed import PrefixStore, ProcessGroup, TCPStore  # type: ignore[attr-defined]

    if getattr(type(group), "WRAPS_A_GROUP", False):  # (a StatelessProcessGroup: its group)
        group = group.group
    if not isinstance(group, Group):
        raise InvalidArgumentError("init_torch_process_group: group must be a ctrlcomm Group or "
                                   f"StatelessProcessGroup, got {type(group).__name__}")

    backend = str(backend).lower()
    if backend not in ("gloo", "nccl"):
        raise InvalidArgumentError(f"init_torch_process_group: unsupported backend {backend!r}")
    td = _timedelta(timeout)
    rank, size = group.rank, group.world_size
    address, peers = endpoint_addresses(group)
    store = None
    if rank == 0:
        # (TCPStore's server listens on every interface: the host is not used here)
        store = TCPStore(host_of(address), 0, size, True, timeout=td,
                         wait_for_workers=False)
        addr = (store.port, os.urandom(8).hex())
    else:
        addr = None
    port, tag = group.broadcast(addr, src=0)
    if store is None:
        # rank 0's host as this rank reaches its group socket (a rank 0 on every interface
        # published no address of its own: see Group.create)
        store = TCPStore(host_of(peers[0]), port, size, False, timeout=td)
    prefix = PrefixStore(f"ctrlcomm/{group.name}/{tag}", store)
    pg = ProcessGroup(prefix, rank, size)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        impl: Any = ProcessGroupGloo(prefix, rank, size, timeout=td)
        btype = ProcessGroup.BackendType.GLOO
        device = torch.device("cpu")
    else:
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = td
        impl = ProcessGroupNCCL(prefix, rank, size, opts)
        btype = ProcessGroup.BackendType.NCCL
        device = torch.device("cuda")
    if hasattr(pg, "_set_default_backend"):
        pg._set_default_backend(btype)
    if hasattr(impl, "_set_sequence_number_for_group"):
        impl._set_sequence_number_for_group()
    pg._register_backend(device, btype, impl)
    return pg  # the backend holds the prefix store, which holds the TCPStore: alive as long


# ------------------------------------------------------------------------------ stores


class TorchStoreError(StoreError, dist.DistStoreError):
    """A :class:`TorchStore` request failed: a ctrlcomm ``StoreError`` that torch code
    catches as ``torch.distributed.DistStoreError`` too."""


class TorchStoreTimeoutError(StoreTimeoutError, TorchStoreError):
    """A :class:`TorchStore` request timed out (``StoreTimeoutError``, ``TimeoutError`` and
    ``torch.distributed.DistStoreError``, as a TCPStore's timeout is)."""


def _as_torch_error(e: StoreError) -> StoreError:
    if isinstance(e, StoreTimeoutError):
        return TorchStoreTimeoutError(str(e), answered=e.answered)
    return TorchStoreError(str(e))


def _seconds(timeout: Any) -> float:
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


class TorchStore(dist.Store):  # type: ignore[misc,name-defined]
    """A ctrlcomm store client as a ``torch.distributed.Store``.

    Hands the store of a ctrlcomm group (``group.store``; the vLLM drop-in's ``pg.store`` is
    one already) to code that wants a torch store: ``PrefixStore(prefix, store)``,
    ``init_process_group(store=...)``, a C++ consumer. Every call has the deadline of the
    store's ``timeout`` (``set_timeout`` changes it); failures raise
    :class:`TorchStoreError` and :class:`TorchStoreTimeoutError`, which torch code catches
    as ``DistStoreError``. ``clone()`` opens another connection to the same store.

    Args:
        client: the :class:`ctrlcomm.StoreClient` to serve through (not closed by this
            object: its owner, the group, closes it).
    """

    def __init__(self, client: StoreClient) -> None:
        super().__init__()
        if not isinstance(client, StoreClient):
            raise InvalidArgumentError(f"TorchStore needs a ctrlcomm StoreClient, got a "
                                       f"{type(client).__name__}")
        self.client = client
        self.set_timeout(datetime.timedelta(seconds=min(client.timeout, 1e9)))

    def _call(self, fn: Any, *args: Any, timeout: Any = None, **kwargs: Any) -> Any:
        t = _seconds(self.timeout if timeout is None else timeout)
        try:
            return fn(*args, timeout=t, **kwargs)
        except StoreError as e:
            raise _as_torch_error(e) from None

    def __repr__(self) -> str:
        return f"TorchStore({self.client!r})"

    def __getattr__(self, name: str) -> Any:
        # (the client's own API, host, port, ping, exists..., as on the client itself)
        if name == "client":
            raise AttributeError(name)
        return getattr(self.client, name)

    # torch's names (getNumKeys and deleteKey too: its C++ side calls those), with the
    # client's keywords (timeout=, get's wait=) besides

    def set(self, key: str, value: str | bytes, *, timeout: Any = None) -> None:
        self._call(self.client.set, key, value, timeout=timeout)

    def get(self, key: str, *, wait: bool = True, timeout: Any = None) -> bytes:
        return self._call(self.client.get, key, wait=wait, timeout=timeout)  # type: ignore[no-any-return]

    def add(self, key: str, value: int, *, timeout: Any = None) -> int:
        return self._call(self.client.add, key, value, timeout=timeout)  # type: ignore[no-any-return]

    def compare_set(self, key: str, expected_value: str | bytes | None,
                    desired_value: str | bytes, *, timeout: Any = None) -> bytes:
        return self._call(self.client.compare_set, key, expected_value,  # type: ignore[no-any-return]
                          desired_value, timeout=timeout)

    def append(self, key: str, value: str | bytes, *, timeout: Any = None) -> None:
        self._call(self.client.append, key, value, timeout=timeout)

    def multi_get(self, keys: list[str], *, wait: bool = True, timeout: Any = None
                  ) -> list[bytes]:
        return self._call(self.client.multi_get, keys, wait=wait, timeout=timeout)  # type: ignore[no-any-return]

    def multi_set(self, keys: list[str], values: list[str | bytes], *,
                  timeout: Any = None) -> None:
        self._call(self.client.multi_set, keys, values, timeout=timeout)

    def delete_key(self, key: str, *, timeout: Any = None) -> bool:
        return self._call(self.client.delete, key, timeout=timeout)  # type: ignore[no-any-return]

    deleteKey = delete_key  # noqa: N815

    def num_keys(self, *, timeout: Any = None) -> int:
        return self._call(self.client.num_keys, timeout=timeout)  # type: ignore[no-any-return]

    getNumKeys = num_keys  # noqa: N815

    def check(self, keys: list[str], *, timeout: Any = None) -> bool:
        return self._call(self.client.check, keys, timeout=timeout)  # type: ignore[no-any-return]

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self._call(self.client.wait, keys, timeout=timeout)

    def list_keys(self, *, timeout: Any = None) -> list[str]:
        return self._call(self.client.list_keys, timeout=timeout)  # type: ignore[no-any-return]

    def queue_push(self, key: str, value: str | bytes, *, timeout: Any = None) -> None:
        self._call(self.client.queue_push, key, value, timeout=timeout)

    def queue_pop(self, key: str, block: bool = True, *, timeout: Any = None) -> bytes:
        return self._call(self.client.queue_pop, key, block, timeout=timeout)  # type: ignore[no-any-return]

    def queue_len(self, key: str, *, timeout: Any = None) -> int:
        return self._call(self.client.queue_len, key, timeout=timeout)  # type: ignore[no-any-return]

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> TorchStore:
        c = self.client
        return TorchStore(StoreClient(c.host, c.port, timeout=_seconds(self.timeout),
                                      prefix=c.prefix, auth_key=c._conn.key, encrypt=c.encrypt))
