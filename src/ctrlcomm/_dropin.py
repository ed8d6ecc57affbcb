"""The one internal interface the drop-ins build on (``ctrlcomm.StatelessProcessGroup``,
``ctrlcomm.AsyncZMQCommunicator``, ``ctrlcomm.torch``): what they need beyond the public API,
named for what it does (and the public classes they use, re-exported here so that they
import nothing else). Nothing else of the package's insides is theirs to use (the import
contracts in ``pyproject.toml`` check it), so the core can change shape under them.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from . import _plans
from ._aio import _Awaited
from ._aio import _coroutine_function as coroutine_function
from ._calls import _rank_arg, _validate_world
from ._drivers import run_sync
from ._group import Group as Group
from ._group import _through_store, close_when_dropped
from .rendezvous._client import StoreClient as StoreClient
from .rendezvous._client import _secs as store_seconds
from .rendezvous._formation import _host_of as host_of
from .rendezvous._server import StoreServer as StoreServer
from .transport._net import auth_key_or_env

__all__ = [
    "Group", "StoreClient", "StoreServer",
    "auth_key_or_env", "awaited", "check_open", "close_when_dropped", "coroutine_function",
    "default_timeout", "endpoint_addresses", "form_through_store", "host_of", "others",
    "rank_arg", "recv", "recv_self", "send", "send_self", "store_seconds",
    "validate_world",
]

form_through_store = _through_store  # (Group.create's formation through a given store)
validate_world = _validate_world  # (rank, world_size) checked: InvalidArgumentError


def rank_arg(group: Group, value: Any, name: str, op: str) -> int:
    """``value`` as a rank of ``group`` (``name`` of ``op``'s argument), or
    InvalidArgumentError saying what is wrong."""
    return _rank_arg(group._core, value, name, op)


def default_timeout(group: Group) -> float:
    """The timeout a call of ``group`` gets when it names none."""
    return group._core.timeout


def send(group: Group, obj: Any, dst: int | tuple[int, ...], tag: int, what: str) -> None:
    """A point-to-point send of ``obj`` to ``dst`` (one rank, or several: encoded once),
    blocking (``what`` names the call in errors)."""
    c = group._core
    run_sync(c, c.send(obj, dst, tag, None, what))


def recv(group: Group, src: int, tag: int, what: str) -> Any:
    """The next object ``src`` sent with ``tag``, blocking."""
    c = group._core
    return run_sync(c, c.recv(src, tag, None, what))


def send_self(group: Group, obj: Any, tag: int, what: str) -> None:
    """A send to this rank itself (kept for :func:`recv_self`)."""
    group._core.send_self(obj, tag, what)


def recv_self(group: Group, tag: int, what: str) -> Any:
    return group._core.recv_self(tag, what)


def check_open(group: Group) -> None:
    """Raise what a call on ``group`` would (closed, broken) where it cannot be used."""
    group._core.check_open()


def others(world_size: int, root: int) -> tuple[int, ...]:
    """The ranks other than ``root``, in the order a plan sends to them."""
    return _plans._others(world_size, root)


def awaited(group: Group, name: str, make: Callable[[], Coroutine[Any, Any, Any]],
            owner: str) -> Coroutine[Any, Any, Any]:
    """An awaited call's coroutine that, cancelled before it began, breaks ``group`` as a
    cancelled collective does (see ``_aio._Awaited``): ``make()`` makes the call as it
    begins; ``owner.name`` is its name."""
    return _Awaited(group._core, name, make, owner)


def endpoint_addresses(group: Group) -> tuple[str, dict[int, str]]:
    """This rank's address and its peers' ("tcp://host:port"), as the group formed."""
    ep = group._core.ep
    return ep.address, dict(ep.peers)
