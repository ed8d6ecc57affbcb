"""Frames of another group, another version, or malformed: dropped, counted, never raised."""

import socket
import time

from ctrlcomm import _wire as w
from ctrlcomm.testing import run_group


def junk_then_work(g):
    if g.rank == 1:
        addr = g._core.ep.peers[0]
        host, port = addr[len("tcp://"):].rsplit(":", 1)
        good = w.Message(w.COLL, 1, g._core.group_id, 0, 0, 7, w.NO_ROOT, w.PICKLE, b"x")
        key = g._core.key  # (MACed as this group's: what is dropped is dropped for the rest)
        frames_list = [
            w.encode(w.Message(w.COLL, 1, 12345, 0, 0, 7, w.NO_ROOT, w.PICKLE, b"x"), key,
                     0),  # another group's
            [bytes(f) for f in w.encode(good, key, 0)],
        ]
        head = bytearray(frames_list[1][0])
        head[2] = 77  # version
        frames_list[1][0] = bytes(head)
        frames_list.append([b"short", b""])  # malformed header
        with socket.create_connection((host, int(port))) as s:
            for frames in frames_list:
                s.sendall(w.stream_prefix(frames) + b"".join(bytes(f) for f in frames))
            s.sendall(b"garbage that is not a stream at all")
        time.sleep(0.3)
    g.barrier()
    result = g.all_reduce(g.rank + 1)
    return result, g.stats()


def test_junk_is_dropped_and_counted():
    (r0, stats0), (r1, _) = run_group(junk_then_work, 2)
    assert r0 == r1 == 3
    d = stats0["dropped"]
    assert d.get("other_group") == 1
    assert d.get("malformed") == 2
    assert d.get("malformed_stream") == 1
    assert stats0["state"] == "open"
