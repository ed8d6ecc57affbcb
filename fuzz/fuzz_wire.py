"""Coverage-guided fuzzing (atheris) of everything that parses bytes from the network.

    python fuzz/fuzz_wire.py -runs=100000        # or -max_total_time=60

Any input must either decode or raise the one decoding error (WireError); the store's state
machine must answer whatever decodes without raising.
"""

import struct
import sys

import atheris

with atheris.instrument_imports():
    from ctrlcomm import _wire as w
    from ctrlcomm._errors import WireError
    from ctrlcomm.rendezvous._state import StoreState

KEY = b"fuzz-key"


def split(data: bytes) -> list[bytes]:
    """Frames from bytes: a count, then length-prefixed chunks (whatever is left)."""
    if not data:
        return []
    n, pos, out = data[0] % 8, 1, []
    for _ in range(n):
        if pos + 2 > len(data):
            break
        ln = struct.unpack_from("<H", data, pos)[0] % 256
        out.append(data[pos + 2 : pos + 2 + ln])
        pos += 2 + ln
    out.append(data[pos:])
    return out


def one_input(data: bytes) -> None:
    frames = split(data)
    for key in (None, KEY):
        try:
            m = w.decode(frames, key)
        except WireError:
            continue
        st = w.decode_status(m)  # (any message read as a status reply: never raises)
        assert st.where in (0, w.STATUS_IN_CALL, w.STATUS_RETURNED) and isinstance(st.text, str)
    dec = w.StreamDecoder(max_message=1 << 20)
    try:
        step = (data[0] % 13 + 1) if data else 1
        for i in range(0, len(data), step):
            dec.feed(data[i : i + step])
    except WireError:
        pass
    try:
        w.decode_store_reply(frames)
    except WireError:
        pass
    reason = w.decode_abort(data)  # (never raises: whatever a peer says is its reason)
    assert isinstance(reason.text, str) and all(type(r) is int for r in reason.ranks)
    assert isinstance(w.said(data), str)  # (a BYE's or STATUS_REP's words: never raises)
    try:
        w.decode_address(data.decode(errors="replace"))
    except WireError:
        pass
    try:
        req = w.decode_store_request(frames)
    except WireError:
        return
    StoreState().handle(b"peer", req, 0.0)


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
