"""vLLM integration: ctrlcomm's group under vLLM's own name.

Code that makes its group with vLLM's class (TRL's weight sync, vLLM's weight-transfer
engine, elastic expert parallelism) and hands it to vLLM's consumers (``PyNcclCommunicator``
checks ``isinstance(group, vllm.distributed.utils.StatelessProcessGroup)``) cannot change an
import. After :func:`install`:

- ``vllm.distributed.utils.StatelessProcessGroup.create(...)`` and
  ``StatelessProcessGroup(rank=, world_size=, store=)``, wherever they are called and however
  the name was imported, make ctrlcomm's group;
- that group is an instance of a class derived from both ctrlcomm's
  :class:`~ctrlcomm.StatelessProcessGroup` and vLLM's, so every ``isinstance`` check of
  either passes; ``ctrlcomm.StatelessProcessGroup`` makes the same class.

Every rank must run it: ctrlcomm's group and vLLM's original do not speak to each other.
For processes you do not start yourself (``trl vllm-serve``, vLLM's worker processes), set
``CTRLCOMM_VLLM=1`` in the environment: every Python process started with it calls
:func:`install` as it starts (a ``.pth`` file installed with ctrlcomm).

vLLM is patched as its ``vllm.distributed.utils`` is imported (at once where it is already):
:func:`install` itself does not import vLLM.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
from collections.abc import Sequence
from typing import Any

from . import _vllm

__all__ = ["install", "installed"]

_MODULE = "vllm.distributed.utils"
_lock = threading.Lock()
_state = {"asked": False}


def install() -> bool:
    """Make vLLM's ``StatelessProcessGroup`` ctrlcomm's, in this process (idempotent).

    Returns:
        ``True`` where vLLM is installed (it is patched now, or as it is imported);
        ``False`` where it is not: nothing changes.
    """
    with _lock:
        if _state["asked"]:
            return True
        try:
            if importlib.util.find_spec("vllm") is None:
                return False
        except (ImportError, ValueError):  # (a broken or half-set-up vllm package)
            return False
        _state["asked"] = True
        module = sys.modules.get(_MODULE)
        if module is None:
            sys.meta_path.insert(0, _Finder())
            return True
    _patch(module)
    return True


def installed() -> type | None:
    """The class both vLLM's and ctrlcomm's names make now (``None`` before vLLM's module
    was patched)."""
    return _vllm.installed_class()


class _Finder(importlib.abc.MetaPathFinder):
    """Patches vLLM's module right after it runs, the first time it is imported."""

    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != _MODULE:
            return None
        with _lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        _patch(module)


def _patch(module: types.ModuleType) -> None:
    """Put ctrlcomm's group under ``module.StatelessProcessGroup`` (vLLM's class): its
    ``create`` and its constructor make an instance of a class derived from both."""
    theirs = getattr(module, "StatelessProcessGroup", None)
    if not isinstance(theirs, type) or _vllm.installed_class() is not None:
        return
    ours = _vllm.StatelessProcessGroup
    both = type("StatelessProcessGroup", (ours, theirs), {
        "__module__": __name__,
        "__doc__": ours.__doc__,
        # (vLLM's is a dataclass: equal where its fields are, and so unhashable)
        "__eq__": object.__eq__,
        "__ne__": object.__ne__,
        "__hash__": object.__hash__,
    })

    def new(cls: type, *args: Any, **kwargs: Any) -> Any:
        return object.__new__(both if cls is theirs else cls)

    theirs.__new__ = staticmethod(new)  # type: ignore[assignment]
    theirs.create = staticmethod(ours.create)  # type: ignore[attr-defined]
    _vllm.install_class(both)
