"""The data-only codec (``codec="msgpack"``): never runs code on decode.

Tuples travel as an extension type so a tuple comes back a tuple (lists stay lists). Anything
msgpack cannot represent raises :class:`ctrlcomm.CodecError` naming the type.
"""

from __future__ import annotations

from typing import Any

from ._errors import CodecError

_TUPLE = 1
_FAILED = 2  # a failed reduction (ctrlcomm._ops.Failed), passed on between ranks


def _msgpack() -> Any:
    try:
        import msgpack
    except ImportError:  # pragma: no cover - depends on the environment
        raise CodecError("codec='msgpack' needs msgpack: pip install 'ctrlcomm[msgpack]'") from None
    return msgpack


def _default(obj: Any) -> Any:
    m = _msgpack()
    if isinstance(obj, tuple):
        return m.ExtType(_TUPLE, dumps(list(obj)))
    from ._errors import Failed

    if type(obj) is Failed:
        return m.ExtType(_FAILED, dumps([obj.message, obj.kind, [list(x) for x in obj.sides]]))
    if type(obj) is int and not -(1 << 63) <= obj < 1 << 64:  # (msgpack's ints: 64 bits)
        text = str(obj) if obj.bit_length() <= 128 else f"of {obj.bit_length()} bits"
        raise OverflowError(f"the int {text} is out of msgpack's range (-2**63 to 2**64-1; "
                            "codec='pickle' carries ints of any size)")
    raise TypeError(f"cannot encode an object of type {type(obj).__name__}")


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _TUPLE:
        return tuple(loads(data))
    if code == _FAILED:
        from ._errors import Failed

        message, kind, *rest = loads(data)
        sides = rest[0] if rest else ()
        if not (type(sides) is list and len(sides) == 2 and all(
                type(side) is list and side and all(type(r) is int and r >= 0 for r in side)
                for side in sides)):
            sides = ()
        return Failed(str(message), str(kind), (tuple(sides[0]), tuple(sides[1])) if sides else ())
    raise ValueError(f"unknown msgpack extension {code}")


def dumps(obj: Any) -> bytes:
    m = _msgpack()
    try:
        return m.packb(obj, default=_default, use_bin_type=True, strict_types=True)  # type: ignore[no-any-return]
    except (TypeError, ValueError, OverflowError, RecursionError) as e:
        # (RecursionError: tuples nested past Python's limit, which the tuple extension
        # encodes by recursion; raised bare, it left the call before anything was sent)
        raise CodecError(f"codec 'msgpack' cannot encode {type(obj).__name__}: "
                         f"{type(e).__name__}: {e}") from None


def loads(data: Any) -> Any:
    m = _msgpack()
    return m.unpackb(bytes(data), ext_hook=_ext_hook, raw=False, strict_map_key=False,
                     use_list=True)
