"""What one formation asks of the store at N ranks: ctrlcomm's own formation protocol
(``rendezvous._formation._rendezvous``), run by N threads against an in-memory store that
counts each rank's requests and the bytes it sends and receives. No sockets: the counts of
a 1k- or 10k-rank formation, which this machine cannot start as processes.

    python benchmarks/formation_counts.py 1000 10000
"""

import os
import sys
import threading
import time

from ctrlcomm import _wire as w
from ctrlcomm.rendezvous._external import _Polled
from ctrlcomm.rendezvous._formation import _rendezvous


class MemStore(_Polled):
    """One rank's client of a shared in-memory store: waits on a condition, no polling."""

    def __init__(self, shared, cond, counts):
        super().__init__("", 600.0)
        self.host, self.port = "memory", 0
        self._d, self._cond, self.n = shared, cond, counts
        self.n.update(requests=0, sent=0, received=0)

    def _count(self, sent=0, received=0):
        self.n["requests"] += 1
        self.n["sent"] += sent
        self.n["received"] += received

    def multi_get(self, keys, *, wait=True, timeout=None):
        ks = [self._k(k) for k in keys]
        end = time.monotonic() + self._t(timeout)
        with self._cond:
            while True:
                got = [self._d.get(k) for k in ks]
                if all(v is not None for v in got) or not wait:
                    break
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        self._count(sum(map(len, ks)), sum(len(v) for v in got if v is not None))
        missing = [k for k, v in zip(ks, got, strict=True) if v is None]
        if missing:
            from ctrlcomm._errors import StoreKeyError, StoreTimeoutError

            if not wait:
                raise StoreKeyError(missing[0])
            raise StoreTimeoutError(f"missing {missing[:3]}")
        return got

    def _get_many(self, keys):
        with self._cond:
            got = [self._d.get(k) for k in keys]
        self._count(sum(map(len, keys)), sum(len(v) for v in got if v is not None))
        return got

    def _put(self, key, value):
        with self._cond:
            self._d[key] = value
            self._cond.notify_all()
        self._count(len(key) + len(value))

    def _put_if_absent(self, key, value):
        with self._cond:
            held = self._d.get(key)
            if held is None:
                self._d[key] = value
                self._cond.notify_all()
        self._count(len(key) + len(value), len(held or b""))
        return held

    def _add(self, key, amount):
        with self._cond:
            new = int(self._d.get(key, b"0")) + amount
            self._d[key] = str(new).encode()
            self._cond.notify_all()
        self._count(len(key) + 8, 8)
        return new

    def _delete(self, key):
        with self._cond:
            had = self._d.pop(key, None) is not None
        self._count(len(key))
        return had

    def multi_delete(self, keys, *, timeout=None):
        """One request, as StoreClient's (its multi_set is one per key, as here)."""
        ks = [self._k(k) for k in keys]
        with self._cond:
            gone = sum(self._d.pop(k, None) is not None for k in ks)
        self._count(sum(map(len, ks)))
        return gone

    def _delete_prefix(self, prefix):
        with self._cond:
            gone = [k for k in self._d if k.startswith(prefix)]
            for k in gone:
                del self._d[k]
        self._count(len(prefix))
        return len(gone)


def record(rank, n):
    """An address line of the size a rank publishes (TCP, heartbeat port, Unix socket,
    IPC and proc ids, settings, join token)."""
    fields = (f"unix:ctrlcomm-{os.urandom(12).hex()}@{os.urandom(8).hex()}",
              "ipc:4026531839", f"proc:{os.urandom(8).hex()}:{100000 + rank}:123456",
              f"ws:{n}", "codec:pickle", "tr:shm", f"wire:{w.VERSION}",
              f"join:{os.urandom(6).hex()}")
    return w.AddressRecord(f"tcp://10.{rank >> 16 & 255}.{rank >> 8 & 255}.{rank & 255}:"
                           f"{20000 + rank % 40000}", 30000 + rank % 30000, fields).encode()


def count(n):
    shared, cond = {}, threading.Condition()
    counts = [{} for _ in range(n)]
    errors = []

    def rank_fn(r):
        try:
            _rendezvous(MemStore(shared, cond, counts[r]), record(r, n), r, n, "count",
                        time.monotonic() + 600, rank0_hosts=False)
        except BaseException as e:  # noqa: BLE001
            errors.append(f"rank {r}: {type(e).__name__}: {e}")

    threading.stack_size(256 * 1024)
    t0 = time.monotonic()
    threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - t0
    if errors:
        raise SystemExit("\n".join(errors[:5]))
    others = counts[1:]
    req = sorted(c["requests"] for c in others)
    total_req = sum(c["requests"] for c in counts)
    recv = sum(c["received"] for c in counts)
    print(f"{n} ranks: requests per rank {req[0]}-{req[-1]} (rank 0: {counts[0]['requests']}), "
          f"{total_req} in all; bytes the store sends {recv / 1e6:.1f} MB "
          f"({others[0]['received'] / 1e3:.0f} KB to a rank), receives "
          f"{sum(c['sent'] for c in counts) / 1e6:.1f} MB; {took:.1f} s here", flush=True)


if __name__ == "__main__":
    for n in map(int, sys.argv[1:] or ["1000"]):
        count(n)
