"""Formation through a store that is not rank 0's: a real etcd server (Debian's etcd-server,
started here on loopback) and a torch TCPStore; a group that loses rank 0 grows back
through etcd; a dead process's keys expire with its lease."""

import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request

import pytest

import ctrlcomm
from ctrlcomm.testing import free_port, kill_ranks, run_ranks

KEY = b"external-store-key"
pytestmark = pytest.mark.etcd


@pytest.fixture(scope="module")
def etcd():
    """An etcd server of its own on loopback ports, ended (by pid) after the module."""
    exe = shutil.which("etcd")
    if exe is None:
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server)")
    pytest.importorskip("etcd3gw")
    data = tempfile.mkdtemp(prefix="ctrlcomm-etcd-")
    client, peer = free_port(), free_port()
    proc = subprocess.Popen(
        [exe, "--data-dir", data, "--name", "t",
         "--listen-client-urls", f"http://127.0.0.1:{client}",
         "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"t=http://127.0.0.1:{peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{client}/health", timeout=1) as r:
                    if b"true" in r.read():
                        break
            except OSError:
                pass
            if time.monotonic() > end or proc.poll() is not None:
                pytest.fail("etcd did not start")
            time.sleep(0.1)
        yield f"127.0.0.1:{client}"
    finally:
        proc.kill()
        proc.wait(10)
        shutil.rmtree(data, ignore_errors=True)


def through_etcd(rank, size, url, name):
    with ctrlcomm.Group.create(None, None, rank, size, name=name, timeout=30, auth_key=KEY,
                               store=url) as g:
        g.store.set(f"from-{rank}", str(rank))  # (the group's store client: etcd's)
        g.barrier()
        seen = sorted(int(g.store.get(f"from-{r}")) for r in range(size))
        return g.all_gather(rank), g.all_reduce(rank), seen


def test_a_group_forms_through_etcd(etcd):
    url = f"etcd://{etcd}/job-{os.getpid()}"
    res = run_ranks(through_etcd, 4, url, "etcd4")
    assert res == [([0, 1, 2, 3], 6, [0, 1, 2, 3])] * 4


def test_etcd_needs_the_auth_key_and_a_url(etcd):
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="needs auth_key"):
        ctrlcomm.Group.create(None, None, 0, 1, store=f"etcd://{etcd}/x")
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="host and port as None"):
        ctrlcomm.Group.create("127.0.0.1", 1234, 0, 1, store=f"etcd://{etcd}/x", auth_key=KEY)
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="etcd://HOST:PORT"):
        ctrlcomm.Group.create(None, None, 0, 1, store=f"http://{etcd}/x", auth_key=KEY)


def grows_through_etcd(rank, size, url):
    size -= 1
    if rank == size:  # a new process, once rank 0 is gone
        g = ctrlcomm.Group.join(None, None, "eg", timeout=30, auth_key=KEY, store=url)
        with g:
            return g.rank, g.all_gather(rank)
    g = ctrlcomm.Group.create(None, None, rank, size, name="eg", timeout=30, auth_key=KEY,
                              store=url, liveness_timeout=2.0)
    kill_ranks(g, [0])
    s = g.shrink()
    with s.grow(size) as big:
        return big.rank, big.all_gather(rank)


def test_rank_0_lost_then_grown_back_through_etcd(etcd):
    res = run_ranks(grows_through_etcd, 4, f"etcd://{etcd}/grow-{os.getpid()}",
                    may_die=(0,))
    assert res[1:] == [(0, [1, 2, 3]), (1, [1, 2, 3]), (2, [1, 2, 3])]


def joins_and_dies(rank, size, url):
    # rank 1 of a group whose rank 0 never comes: its key waits in etcd, on its lease
    ctrlcomm.Group.create(None, None, 1, 2, name="lease", timeout=60, auth_key=KEY,
                          store=url)


def test_a_dead_process_keys_expire_with_its_lease(etcd):
    from etcd3gw.client import Etcd3Client

    host, port = etcd.split(":")
    prefix = f"lease-{os.getpid()}"
    c = Etcd3Client(host=host, port=int(port))
    key = f"{prefix}/ctrlcomm/lease/ctrlcomm:formation/rank/1"
    with pytest.raises(ctrlcomm.testing.RankFailedError):
        run_ranks(_killed_once_keyed, 1, f"etcd://{etcd}/{prefix}", key, timeout=30)
    assert c.get(key)  # (there as it died)
    end = time.monotonic() + 15
    while c.get(key) and time.monotonic() < end:
        time.sleep(0.2)
    assert c.get(key) == []  # (gone with its lease: 10 s after its last renewal at most)


def _killed_once_keyed(rank, size, url, key):
    import threading

    from etcd3gw.client import Etcd3Client

    host, port = url[len("etcd://"):].split("/")[0].split(":")
    c = Etcd3Client(host=host, port=int(port))

    def watch():
        end = time.monotonic() + 20
        while not c.get(key) and time.monotonic() < end:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)  # (its key set: it dies without a word)

    threading.Thread(target=watch, daemon=True).start()
    joins_and_dies(rank, size, url)


# ------------------------------------------------------------------------------ TCPStore


def through_tcpstore(rank, size, port):
    from datetime import timedelta

    from torch.distributed import TCPStore

    st = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    with ctrlcomm.Group.create(None, None, rank, size, name="tcps", timeout=30, auth_key=KEY,
                               store=st) as g:
        return g.all_gather(rank), g.all_reduce(rank)


def test_a_group_forms_through_a_torch_tcpstore():
    torch_dist = pytest.importorskip("torch.distributed")
    from datetime import timedelta

    port = free_port()
    master = torch_dist.TCPStore("127.0.0.1", port, is_master=True,
                                 wait_for_workers=False, timeout=timedelta(seconds=30))
    try:
        res = run_ranks(through_tcpstore, 3, port)
    finally:
        del master
    assert res == [([0, 1, 2], 3)] * 3
