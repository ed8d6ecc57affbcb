"""A group over the ranks of a torch process group (``Group.from_torch``,
``ctrlcomm.torch.group_from_torch``): the group's leader serves a store and broadcasts its
address through torch once. torch is imported only when a group is formed this way."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any

from ._calls import _timeout_arg
from ._errors import FormationError, FormationTimeoutError, InvalidArgumentError
from .rendezvous._formation import _bind_address
from .rendezvous._hosting import _acquire_server, _release_server
from .transport._net import _wildcard, auth_key_or_env, local_address_for, resolve

if TYPE_CHECKING:
    from ._group import Group

log = logging.getLogger("ctrlcomm")


def _default_host(timeout: float) -> str:
    """An address of this machine that the other ranks can reach.

    The interface toward torchrun's ``MASTER_ADDR`` when it is set (the peers reach that
    network too), else what this host's name resolves to, else loopback. Names are looked up
    within ``timeout`` seconds in all (and a second more for this host's name, where looking
    ``MASTER_ADDR`` up took them).
    """
    deadline = time.monotonic() + timeout
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            return local_address_for(resolve(master, deadline - time.monotonic()),
                                     int(os.environ.get("MASTER_PORT", "29500")))
        except (OSError, UnicodeError, ValueError) as e:  # (TimeoutError, socket.gaierror)
            log.warning("Group.from_torch: no route to MASTER_ADDR=%r found (%s: %s): the "
                        "store binds to what this host's name resolves to, or loopback",
                        master, type(e).__name__, e)
    try:  # (a second or more, where looking MASTER_ADDR up took the time)
        return resolve(socket.gethostname(), max(deadline - time.monotonic(), 1.0))
    except (OSError, UnicodeError):
        return "127.0.0.1"


def _leader_host(hostname: Any, timeout: float) -> str:
    """The address the leader's store binds to: ``hostname`` looked up (within
    ``timeout``), or :func:`_default_host`."""
    if hostname is None or hostname == "":  # ("": as None, as it always was)
        return _default_host(timeout)
    try:
        return _bind_address(hostname, timeout, "Group.from_torch: hostname")
    except TimeoutError as e:
        raise FormationTimeoutError(f"Group.from_torch: hostname: {e}") from None


def form(cls: type[Group], process_group: Any = None, *, hostname: str | None = None,
         name: str = "torch", timeout: float = 300.0, **kwargs: Any) -> Group:
    """:func:`ctrlcomm.torch.group_from_torch`, forming a ``cls`` (see there)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise InvalidArgumentError("Group.from_torch: torch.distributed is not initialized")
    t = _timeout_arg(timeout, "Group.from_torch")
    if t is None:
        raise InvalidArgumentError("Group.from_torch: timeout must be > 0 seconds, got None")
    pg = process_group if process_group is not None else dist.group.WORLD
    rank = dist.get_rank(pg)
    if rank < 0:
        raise InvalidArgumentError("Group.from_torch: this rank is not a member of the group")
    size = dist.get_world_size(pg)
    leader = dist.get_process_group_ranks(pg)[0]
    served: tuple[str, int] | None = None  # (the leader's store, as _release_server takes it)
    info: list[Any] = [None]
    try:
        if rank == 0:
            try:
                host = _leader_host(hostname, t)
                server = _acquire_server(host, 0, auth_key_or_env(kwargs.get("auth_key") or None),
                                         bool(kwargs.get("encrypt")))
                served = (host, server.port)
                # (a store on every interface: the members are told this host's address
                # that reaches them, not 0.0.0.0, which would send each to its own host)
                info = [(_default_host(t) if _wildcard(host) else host, server.port)]
            except Exception as e:
                # the others wait for the address in the broadcast below, up to torch's
                # timeout (30 minutes by default): they are told instead
                dist.broadcast_object_list([f"{type(e).__name__}: {e}"], src=leader, group=pg)
                raise
        dist.broadcast_object_list(info, src=leader, group=pg)
        if isinstance(info[0], str):
            raise FormationError(f"Group.from_torch: the group's leader (global rank {leader}) "
                                 f"could not serve the store: {info[0]}")
        host, port = info[0]
        g = cls.create(host, port, rank, size, name=name, timeout=timeout, host_store=False,
                         **kwargs)
    except BaseException:
        if served is not None:  # (the leader's store, taken: given back)
            _release_server(*served)
        raise
    if served is not None:
        # the leader's group keeps its store, as Group.create's rank 0 does: every rank's
        # ``group.store`` talks to it until the leader's group is closed
        g._keep_server(served)
    return g
