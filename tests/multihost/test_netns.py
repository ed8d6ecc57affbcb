"""A group across three hosts: network namespaces on a bridge, made by this test (root).

Each fault asserts which error each survivor raised and how long it took to notice.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns import MARKS, sh

pytestmark = MARKS

PREFIX = f"cc{os.getpid() % 10000}"
SW = f"{PREFIX}sw"
HOSTS = [f"{PREFIX}h{i}" for i in (1, 2, 3)]
ADDR = [f"10.213.{os.getpid() % 200}.{i}" for i in (1, 2, 3)]
RANK = Path(__file__).with_name("netns_rank.py")


def ns(host, *cmd, check=True):
    return sh("ip", "netns", "exec", host, *cmd, check=check)


@pytest.fixture(scope="module")
def net():
    sh("ip", "netns", "add", SW)
    ns(SW, "ip", "link", "add", "br0", "type", "bridge")
    ns(SW, "ip", "link", "set", "br0", "up")
    for i, (h, a) in enumerate(zip(HOSTS, ADDR, strict=True), 1):
        sh("ip", "netns", "add", h)
        sh("ip", "link", "add", f"{PREFIX}v{i}", "type", "veth", "peer", "name", f"{PREFIX}p{i}")
        sh("ip", "link", "set", f"{PREFIX}v{i}", "netns", h)
        sh("ip", "link", "set", f"{PREFIX}p{i}", "netns", SW)
        ns(h, "ip", "link", "set", f"{PREFIX}v{i}", "name", "eth0")
        ns(h, "ip", "addr", "add", f"{a}/24", "dev", "eth0")
        ns(h, "ip", "link", "set", "eth0", "up")
        ns(h, "ip", "link", "set", "lo", "up")
        ns(SW, "ip", "link", "set", f"{PREFIX}p{i}", "master", "br0")
        ns(SW, "ip", "link", "set", f"{PREFIX}p{i}", "up")
    yield
    for h in [*HOSTS, SW]:
        sh("ip", "netns", "del", h, check=False)


class Cluster:
    """A store on host 1 (its own process) and one rank per host."""

    def __init__(self, iters, liveness=3.0, payload=0, port=29711):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.store = subprocess.Popen(
            ["ip", "netns", "exec", HOSTS[0], sys.executable, "-m", "ctrlcomm", "store",
             "--host", ADDR[0], "--port", str(port)], stdout=subprocess.PIPE, text=True,
            env=env)
        self.store.stdout.readline()
        self.ranks = [subprocess.Popen(
            ["ip", "netns", "exec", HOSTS[r], sys.executable, str(RANK), ADDR[0], str(port),
             str(r), "3", str(iters), str(liveness), str(payload)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for r in range(3)]
        self.formed = [json.loads(p.stdout.readline()) for p in self.ranks]

    def results(self, timeout=60, skip=()):
        out = {}
        for r, p in enumerate(self.ranks):
            if r in skip:
                continue
            line, err = p.communicate(timeout=timeout)
            out[r] = json.loads(line.strip().splitlines()[-1]) if line.strip() else {"err": err}
        return out

    def close(self):
        for p in [*self.ranks, self.store]:
            if p.poll() is None:
                p.kill()  # by pid: only processes this test started
            p.wait(10)
            for f in (p.stdout, p.stderr):
                if f is not None:
                    f.close()


def test_group_across_three_hosts(net):
    c = Cluster(iters=50)
    try:
        res = c.results()
        assert all(r["event"] == "ok" and r["done"] == 50 for r in res.values()), res
    finally:
        c.close()


@pytest.mark.parametrize("fault", ["kill", "stop", "link_down"])
def test_lost_rank_is_named_by_every_survivor(net, fault):
    c = Cluster(iters=100000, liveness=3.0)
    try:
        time.sleep(1.0)
        t = time.time()
        if fault == "kill":
            os.kill(c.ranks[2].pid, signal.SIGKILL)
        elif fault == "stop":
            os.kill(c.ranks[2].pid, signal.SIGSTOP)
        else:
            ns(SW, "ip", "link", "set", f"{PREFIX}p3", "down")
        res = c.results(skip=(2,))
        for r in (0, 1):
            got = res[r]
            assert got["event"] == "error" and got["type"] == "PeerLostError", got
            assert got["ranks"] == [2] or "rank 2" in got["msg"], got
            took = got["at"] - t
            limit = 2.0 if fault == "kill" else 3.0 + 2.0
            assert took < limit, f"{fault}: rank {r} noticed after {took:.2f} s"
            print(f"{fault}: rank {r} raised {got['type']} after {took:.2f} s: {got['msg']}")
    finally:
        if fault == "link_down":
            ns(SW, "ip", "link", "set", f"{PREFIX}p3", "up", check=False)
        c.close()


def test_store_host_killed_after_formation(net):
    c = Cluster(iters=100)
    try:
        c.store.kill()
        res = c.results()
        assert all(r["event"] == "ok" and r["done"] == 100 for r in res.values()), res
    finally:
        c.close()


def test_squeezed_link_is_slower_not_wrong(net):
    ns(HOSTS[2], "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "2mbit",
       "burst", "32kbit", "latency", "400ms")
    try:
        c = Cluster(iters=20, payload=64 * 1024)
        try:
            res = c.results(timeout=120)
            assert all(r["event"] == "ok" and r["done"] == 20 for r in res.values()), res
        finally:
            c.close()
    finally:
        ns(HOSTS[2], "tc", "qdisc", "del", "dev", "eth0", "root", check=False)


@pytest.mark.skipif(shutil.which("nft") is None, reason="needs nftables (Debian's nftables)")
def test_five_percent_packet_loss_is_slower_not_wrong(net):
    for h in HOSTS:
        ns(h, "nft", "add", "table", "inet", "ccloss")
        ns(h, "nft", "add", "chain", "inet", "ccloss", "out",
           "{ type filter hook output priority 0 ; }")
        ns(h, "nft", "add", "rule", "inet", "ccloss", "out", "numgen", "random", "mod", "100",
           "<", "5", "drop")
    try:
        c = Cluster(iters=200, liveness=10.0)
        try:
            res = c.results(timeout=120)
            assert all(r["event"] == "ok" and r["done"] == 200 for r in res.values()), res
        finally:
            c.close()
    finally:
        for h in HOSTS:
            ns(h, "nft", "delete", "table", "inet", "ccloss", check=False)


TRL_RANK = """
import json, sys
import ctrlcomm
host, port, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pg = ctrlcomm.StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=3,
                                           store_timeout=30)
uid = pg.broadcast_obj(b"nccl-unique-id" if rank == 0 else None, src=0)
ranks = pg.all_gather_obj(rank)
pg.send_obj(rank, dst=(rank + 1) % 3)
prev = pg.recv_obj(src=(rank + 2) % 3)
pg.barrier(timeout=30)
# and torch's gloo over the same ranks (rank 0 bound every interface, published no address:
# each rank reaches it where it reaches its group socket)
import torch
from ctrlcomm.torch import init_torch_process_group
tpg = init_torch_process_group(pg, backend="gloo", timeout=30)
t = torch.tensor([rank + 1.0])
tpg.allreduce([t]).wait()
pg.barrier(timeout=30)  # (every rank done with gloo)
print(json.dumps({"uid": uid.decode(), "ranks": ranks, "prev": prev, "gloo": t.item()}),
      flush=True)
pg.close()
import os
os._exit(0)  # (torch aborts now and then at exit with a gloo group alive, ctrlcomm or not)
"""


def test_workers_on_every_interface_and_a_trainer_elsewhere(net):
    """TRL's weight sync: the vLLM workers (ranks 0 and 1, on host 1) create their
    StatelessProcessGroup with host "0.0.0.0"; the trainer (rank 2, on host 2) with host 1's
    address. (before: rank 0 bound its socket to the loopback and published 127.0.0.1,
    where rank 2 found nothing: "rank 0 is gone (cannot connect to tcp://127.0.0.1:...)")"""
    port = 29713
    where = [(HOSTS[0], "0.0.0.0"), (HOSTS[0], "0.0.0.0"), (HOSTS[1], ADDR[0])]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0")  # (gloo's own choice: the hostname's)
    procs = [subprocess.Popen(["ip", "netns", "exec", h, sys.executable, "-c", TRL_RANK, host,
                               str(port), str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
             for r, (h, host) in enumerate(where)]
    try:
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, f"rank {r}: {err}"
            got = json.loads(out.strip().splitlines()[-1])
            assert got == {"uid": "nccl-unique-id", "ranks": [0, 1, 2], "prev": (r + 2) % 3,
                           "gloo": 6.0}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # by pid: only processes this test started
            p.wait(10)


def test_a_rank_0_on_the_loopback_says_why_ranks_elsewhere_do_not_join(net):
    """vLLM's TCPStore listens on every interface whatever its host, so a rank 0 given
    127.0.0.1 there meets ranks given its host's address; ctrlcomm's store listens where it
    is told. Rank 0's timeout says so (before: "ranks [1] did not join", and nothing more)."""
    port = 29714
    code = """
import sys, ctrlcomm
try:
    ctrlcomm.Group.create(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), 2, timeout=3)
except ctrlcomm.FormationTimeoutError as e:
    print(type(e).__name__, e.missing, e, flush=True)
"""
    procs = [subprocess.Popen(["ip", "netns", "exec", h, sys.executable, "-c", code, host,
                               str(port), str(r)], stdout=subprocess.PIPE, text=True)
             for r, (h, host) in enumerate([(HOSTS[0], "127.0.0.1"), (HOSTS[1], ADDR[0])])]
    try:
        out = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # by pid: only processes this test started
            p.wait(10)
    assert out[0].startswith("FormationTimeoutError [1] "), out
    assert "listens on the loopback address 127.0.0.1 only" in out[0], out
    assert out[1].startswith("FormationStoreTimeoutError [0] "), out


FROM_TORCH_RANK = """
import json, sys
import torch.distributed as dist
import ctrlcomm
rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2)  # (MASTER_ADDR, as torchrun sets)
g = ctrlcomm.Group.from_torch(hostname="0.0.0.0", timeout=30)
got = g.all_gather(rank)
g.close()
dist.destroy_process_group()
print(json.dumps(got), flush=True)
"""


def test_from_torch_with_a_leader_on_every_interface_across_hosts(net):
    """(before: the leader told the members its store was at 0.0.0.0, which sent each to
    its own host: FormationStoreTimeoutError on rank 1)"""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", MASTER_ADDR=ADDR[0],
               MASTER_PORT="29715")
    procs = [subprocess.Popen(["ip", "netns", "exec", HOSTS[r], sys.executable, "-c",
                               FROM_TORCH_RANK, str(r)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(2)]
    try:
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, f"rank {r}: {err}"
            assert json.loads(out.strip().splitlines()[-1]) == [0, 1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # by pid: only processes this test started
            p.wait(10)


def test_a_group_of_two_hosts_of_two_ranks_mixes_shared_memory_and_tcp(net):
    """Ranks of one host send through shared memory, to the other host's over TCP; the
    results are those of any group."""
    port = 29713
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    store = subprocess.Popen(
        ["ip", "netns", "exec", HOSTS[0], sys.executable, "-m", "ctrlcomm", "store",
         "--host", ADDR[0], "--port", str(port)], stdout=subprocess.PIPE, text=True, env=env)
    ranks = []
    try:
        store.stdout.readline()
        ranks = [subprocess.Popen(
            ["ip", "netns", "exec", HOSTS[r // 2], sys.executable,
             str(RANK.with_name("shm_rank.py")), ADDR[0], str(port), str(r), "4"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for r in range(4)]
        outs = []
        for p in ranks:
            line, err = p.communicate(timeout=60)
            assert line.strip(), err
            outs.append(json.loads(line))
    finally:
        for p in [*ranks, store]:
            if p.poll() is None:
                p.kill()  # by pid: only processes this test started
            p.wait(10)
            p.stdout.close()
    for r, out in enumerate(outs):
        assert out["gather"] == [0, 1, 2, 3] and out["sum"] == 6
        assert out["a2a"] == [s * 10 + r for s in range(4)]
        assert out["bcast"] == 3 << 20 and out["p2p"] == (r - 1) % 4
        assert out["kind"] == "shm"
        assert out["rings"] == [r ^ 1], out  # (its host's other rank; the others over TCP)
