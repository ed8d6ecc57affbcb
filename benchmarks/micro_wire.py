"""Micro-benchmarks of the pure layers (no sockets): framing, codecs, the stream decoder.

    python benchmarks/micro_wire.py
"""

import pickle
import timeit

from ctrlcomm import _wire as w
from ctrlcomm._ops import resolve


def main() -> None:
    small = (123, 456)
    payload, bufs = w.dumps(small, w.PICKLE)
    msg = w.Message(w.COLL, 1, 0xABCDEF, 42, 0, 7, w.NO_ROOT, w.PICKLE, payload, bufs)
    frames = w.encode(msg)
    keyed = w.encode(msg, b"k" * 32)
    stream = w.stream_prefix(frames) + b"".join(frames)
    dec = w.StreamDecoder()
    big = bytes(1 << 20)
    combine = resolve("max", "all_reduce", 0)
    cases = {
        "dumps (2 ints)": lambda: w.dumps(small, w.PICKLE),
        "dumps (1 MiB bytes, out of band)": lambda: w.dumps(big, w.PICKLE),
        "encode header": lambda: w.encode(msg),
        "encode header + MAC": lambda: w.encode(msg, b"k" * 32),
        "decode": lambda: w.decode(frames),
        "decode + MAC check": lambda: w.decode(keyed, b"k" * 32),
        "stream decoder, one message": lambda: dec.feed(stream),
        "loads (2 ints)": lambda: pickle.loads(payload),
        "combine max (2-tuple)": lambda: combine((1, 9), (5, 2)),
    }
    for name, fn in cases.items():
        n = 200 if "MiB" in name else 100_000
        t = min(timeit.repeat(fn, number=n, repeat=3)) / n
        print(f"{name:<36} {t * 1e6:9.2f} us")


if __name__ == "__main__":
    main()
