"""Reduction operators: named element-wise ops and user callables.

A named op applies to numbers, to tuples/lists of them (element-wise, container type kept,
nested containers too), and to numpy arrays or torch tensors. Python ints keep arbitrary size.

A failed combination does not raise inside the algorithm: it becomes a :class:`Failed` value
that absorbs everything it is combined with, so every rank still runs the whole message
pattern of the collective (the group stays in step) and then raises the same error.
"""

from __future__ import annotations

import functools
import numbers
import operator
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

from ._errors import Failed as Failed
from ._errors import InvalidArgumentError, show
from ._errors import rank_list as rank_list

NAMED_OPS = ("sum", "prod", "max", "min", "band", "bor", "land", "lor")
Op = str | Callable[[Any, Any], Any]


def _array_module(x: Any) -> Any:
    mod = type(x).__module__.split(".", 1)[0]
    if mod == "torch":
        import torch

        return torch
    if mod == "numpy":
        import numpy

        return numpy
    return None


_PLAIN = frozenset({int, float, bool})  # numbers combined without looking further


# max and min of numbers: the first of equals; a NaN on either side gives NaN, as numpy's
# and torch's maximum and minimum do (so a NaN on any rank reaches every rank's result,
# whatever the algorithm's order of combining; ``a if a >= b else b`` alone would give the
# other operand where either is NaN: max(nan, 1) nan but max(1, nan) 1)


def _maximum(a: Any, b: Any) -> Any:
    if type(a) in _PLAIN and type(b) in _PLAIN:
        return a if a >= b or a != a else b
    m = _array_module(a) or _array_module(b)
    return m.maximum(a, b) if m is not None else (a if a >= b or a != a else b)


def _minimum(a: Any, b: Any) -> Any:
    if type(a) in _PLAIN and type(b) in _PLAIN:
        return a if a <= b or a != a else b
    m = _array_module(a) or _array_module(b)
    return m.minimum(a, b) if m is not None else (a if a <= b or a != a else b)


def _logical(name: str) -> Callable[[Any, Any], Any]:
    def f(a: Any, b: Any) -> Any:
        m = _array_module(a) or _array_module(b)
        if m is not None:
            return getattr(m, f"logical_{name}")(a, b)
        r = (bool(a) and bool(b)) if name == "and" else (bool(a) or bool(b))
        # MPI semantics: a logical op on ints gives 0/1 of the same type; on bools a bool.
        return r if isinstance(a, bool) and isinstance(b, bool) else int(r)

    return f


_LEAF: dict[str, Callable[[Any, Any], Any]] = {
    "sum": operator.add,
    "prod": operator.mul,
    "max": _maximum,
    "min": _minimum,
    "band": operator.and_,
    "bor": operator.or_,
    "land": _logical("and"),
    "lor": _logical("or"),
}


def _elementwise(leaf: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
    if isinstance(a, (tuple, list)):
        if not isinstance(b, (tuple, list)):
            raise TypeError(f"cannot combine a {type(a).__name__} with a {type(b).__name__}")
        if len(a) != len(b):
            raise ValueError(f"operands have different lengths ({len(a)} and {len(b)})")
        out = [leaf(x, y) if type(x) in _PLAIN and type(y) in _PLAIN
               else _elementwise(leaf, x, y) for x, y in zip(a, b, strict=True)]
        t = type(a)
        if t is list or t is tuple:
            return out if t is list else tuple(out)
        make = getattr(t, "_make", None)  # a named tuple is built from one iterable
        return make(out) if make is not None else t(out)
    if isinstance(b, (tuple, list)):
        raise TypeError(f"cannot combine a {type(a).__name__} with a {type(b).__name__}")
    sa = _shape(a)
    if sa != _shape(b):  # (arrays of other shapes: numpy and torch would broadcast them)
        raise ValueError(f"operands have different shapes ({_show_shape(sa)} and "
                         f"{_show_shape(_shape(b))})")
    return leaf(a, b)


def _shape(x: Any) -> tuple[int, ...]:
    """The shape of a numpy array or torch tensor; () for anything else (a number, or a
    numpy or torch scalar, which combine with numbers as numbers)."""
    if _array_module(x) is None:
        return ()
    return tuple(getattr(x, "shape", ()))


def _show_shape(shape: tuple[int, ...]) -> str:
    return f"shape {shape}" if shape else "a scalar"


def resolve(op: Op, opname: str, rank: int) -> Callable[[Any, Any], Any]:
    """The combine function for ``op``; raises :class:`InvalidArgumentError` for bad ops."""
    if callable(op):
        user = op

        def combine_user(a: Any, b: Any) -> Any:
            return user(a, b)

        return combine_user
    if not isinstance(op, str) or op not in _LEAF:
        raise InvalidArgumentError(
            f"{opname} on rank {rank}: unknown op {show(op)}; use one of {', '.join(NAMED_OPS)} "
            "or a callable f(a, b)"
        )
    leaf = _LEAF[op]

    def combine(a: Any, b: Any) -> Any:
        return _elementwise(leaf, a, b)

    return combine


def plain_types(op: Op) -> frozenset[type]:
    """The number types a named op reduces as they are, alone or as the items of a list or
    tuple (the usual operand, which the caller passes without :func:`check_operand`); none
    for a callable."""
    if callable(op):
        return frozenset()
    return frozenset((int, bool) if op in ("band", "bor") else (int, bool, float))


def _integral_dtype(dtype: Any) -> bool:
    """Whether an array's (numpy's or torch's) elements are ints or bools."""
    kind = getattr(dtype, "kind", None)  # numpy: "b", "i", "u"; "f", "c"...
    if isinstance(kind, str):  # (objects, "O": Python ints, say; their & says what fails)
        return kind in "biuO"
    return not (getattr(dtype, "is_floating_point", False) or getattr(dtype, "is_complex", False))


def check_operand(op: Op, value: Any, opname: str, rank: int) -> None:
    """Reject, before anything is sent, a local value a named op cannot reduce."""
    if callable(op):
        return
    integral = op in ("band", "bor")
    plain = plain_types(op)

    def walk(v: Any) -> None:
        if type(v) in plain:  # the common case, without the slower ABC checks below
            return
        if isinstance(v, (tuple, list)):
            for x in v:
                if type(x) not in plain:
                    walk(x)
            return
        if _array_module(v) is not None and hasattr(v, "dtype"):
            if integral and not _integral_dtype(v.dtype):  # (a float array to band)
                raise InvalidArgumentError(
                    f"{opname} on rank {rank}: op {op!r} needs integers (or bools), got "
                    f"{type(v).__name__} of dtype {v.dtype}")
            return
        ok = isinstance(v, numbers.Integral) if integral else isinstance(v, numbers.Number)
        if not ok or (op in ("max", "min") and isinstance(v, numbers.Complex)
                      and not isinstance(v, numbers.Real)):
            need = "integers" if integral else "real numbers" if op in ("max", "min") else "numbers"
            raise InvalidArgumentError(
                f"{opname} on rank {rank}: op {op!r} needs {need} or tuples/lists of them, "
                f"got {show(v)} ({type(v).__name__})"
            )

    walk(value)


def safe(combine: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Wrap ``combine`` so errors become :class:`Failed` values instead of exceptions."""

    def f(a: Any, b: Any) -> Any:
        if isinstance(a, Failed):
            return a
        if isinstance(b, Failed):
            return b
        try:
            return combine(a, b)
        except Exception as e:  # the op is user code or user data: report, stay in step
            return Failed(f"{type(e).__name__}: {e}")

    return f


# The named ops over flat lists/tuples of plain numbers (the usual operand: a few ints), with
# no Python call per element: each gives an iterable of the results (a map built in C where
# the op is one of operator's; max and min keep the first of equals, and _maximum's and
# _minimum's answer for NaN); the same results as _elementwise with the op's leaf.
_FLAT: dict[str, Callable[[Any, Any], Any]] = {
    "sum": functools.partial(map, operator.add),
    "prod": functools.partial(map, operator.mul),
    "max": lambda a, b: [x if x >= y or x != x else y for x, y in zip(a, b, strict=True)],
    "min": lambda a, b: [x if x <= y or x != x else y for x, y in zip(a, b, strict=True)],
    "band": functools.partial(map, operator.and_),
    "bor": functools.partial(map, operator.or_),
}


def combiner(op: Op, opname: str, rank: int) -> Callable[[Any, Any], Any]:
    """``safe(resolve(op, ...))``, with fast paths for named ops on plain numbers and on flat
    lists/tuples of them (one call per combination instead of several per element)."""
    combine = safe(resolve(op, opname, rank))
    flat = _FLAT.get(op) if type(op) is str else None
    if flat is None:
        return combine
    leaf = _LEAF[op]  # type: ignore[index]
    plain = _PLAIN

    def named(a: Any, b: Any) -> Any:
        ta = type(a)
        if (ta is list or ta is tuple) and type(b) is ta and len(a) == len(b):
            if plain.issuperset(map(type, a)) and plain.issuperset(map(type, b)):
                try:
                    return ta(flat(a, b))
                except Exception as e:  # e.g. a huge int times a float: overflow
                    return Failed(f"{type(e).__name__}: {e}")
        elif ta in plain and type(b) in plain:
            try:
                return leaf(a, b)
            except Exception as e:
                return Failed(f"{type(e).__name__}: {e}")
        return combine(a, b)

    # the same left fold of a list of operands (a root's, in rank order) in one pass of C
    # where the operands are alike: all the same plain number type, or all lists or all
    # tuples of one length of them; a column at a time, the same operator in the same order
    # (bitwise the same result). max and min only over ints: max() and min() keep the first
    # of equals as the fold does, but answer otherwise for NaN. Anything else, or an error,
    # the pairwise way.
    column = _COLUMN.get(op) if type(op) is str else None
    alike = frozenset((int, bool)) if op in ("max", "min", "band", "bor") else frozenset(plain)

    def fold(vals: Sequence[Any]) -> Any:
        first = vals[0]
        ta = type(first)
        if column is not None and len(set(map(type, vals))) == 1:
            try:
                if ta is list or ta is tuple:
                    if len(set(map(len, vals))) == 1 and \
                            alike.issuperset(map(type, chain.from_iterable(vals))):
                        return ta(map(column, zip(*vals, strict=True)))
                elif ta in alike:
                    return column(vals)
            except Exception:  # (as the pairwise way would meet it: its Failed, below)
                pass
        acc = first
        for v in vals[1:]:
            acc = named(acc, v)
        return acc

    named.fold = fold  # type: ignore[attr-defined]  # (see _plans.fold)
    return named


# A named op's fold of one column (a tuple of operands in rank order), where _FLAT has the op.
_COLUMN: dict[str, Callable[[Any], Any]] = {
    "sum": functools.partial(functools.reduce, operator.add),
    "prod": functools.partial(functools.reduce, operator.mul),
    "max": max,
    "min": min,
    "band": functools.partial(functools.reduce, operator.and_),
    "bor": functools.partial(functools.reduce, operator.or_),
}
