"""Host names looked up within the caller's deadline, against a DNS server that never answers.

The test makes a network namespace (root) whose resolv.conf names a server on the namespace's
own loopback that reads queries and answers none, with a resolver timeout of 12 s: a lookup
without a deadline of its own takes those 12 s. Its hosts file is Debian's stock one, where
``ip6-localhost`` is ``::1`` only (glibc answers 127.0.0.1 when asked for IPv4, as ZeroMQ and
IPv4 sockets ask); it also names this machine and the IPv4-mapped loopback (torch looks
up both when its process group starts).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from netns import MARKS, sh

pytestmark = MARKS

NS = f"ccdns{os.getpid() % 100000}"
RESOLVER_S = 12

# answers nothing, but SERVFAIL (the DNS is down) to a query for a name that begins "down."
SILENT_DNS = """
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.1", 53))
print("ready", flush=True)
while True:
    q, peer = s.recvfrom(4096)
    if q[12:17] == b"\\x04down":
        s.sendto(q[:2] + b"\\x81\\x82" + q[4:6] + bytes(6) + q[12:], peer)
"""
V6_ONLY = "fd00::81"  # (this name's address in the hosts file, on the namespace's loopback)


@pytest.fixture(scope="module")
def dark_dns():
    conf = Path("/etc/netns") / NS  # (`ip netns exec` mounts its files over /etc's)
    sh("ip", "netns", "del", NS, check=False)  # (one a killed run left)
    sh("ip", "netns", "add", NS)
    dns = None
    try:
        sh("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")
        conf.mkdir(parents=True, exist_ok=True)
        (conf / "resolv.conf").write_text(f"nameserver 127.0.0.1\n"
                                          f"options timeout:{RESOLVER_S} attempts:1\n")
        (conf / "hosts").write_text(f"127.0.0.1 localhost {socket.gethostname()}\n"
                                    "::1 localhost ip6-localhost ip6-loopback\n"
                                    "::ffff:127.0.0.1 localhost\n"
                                    f"{V6_ONLY} down.v6only.example\n")
        sh("ip", "netns", "exec", NS, "ip", "-6", "addr", "add", f"{V6_ONLY}/128", "dev", "lo")
        dns = subprocess.Popen(["ip", "netns", "exec", NS, sys.executable, "-c", SILENT_DNS],
                               stdout=subprocess.PIPE, text=True)
        assert dns.stdout.readline().strip() == "ready"
        yield NS
    finally:
        if dns is not None:
            dns.kill()  # (by pid: the process this fixture started)
            dns.wait(10)
            dns.stdout.close()
        sh("ip", "netns", "del", NS, check=False)
        shutil.rmtree(conf, ignore_errors=True)


def in_dark(ns, body, timeout=RESOLVER_S * 3):
    """Run ``body`` (Python; it prints one JSON line) in the namespace; its result."""
    code = textwrap.dedent("""
        import json, time
        import ctrlcomm
        from ctrlcomm.testing import free_port

        def attempt(fn):
            t = time.monotonic()
            try:
                fn()
                out = {"error": None}
            except Exception as e:
                out = {"error": type(e).__name__, "msg": str(e),
                       "timeout": isinstance(e, TimeoutError),
                       "formation": isinstance(e, ctrlcomm.FormationTimeoutError),
                       "store": isinstance(e, ctrlcomm.StoreTimeoutError),
                       "answered": getattr(e, "answered", None)}
            out["took"] = time.monotonic() - t
            return out
    """) + textwrap.dedent(body)
    p = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_namespace_resolver_does_hang(dark_dns):
    """(what the tests below stand on: a bare lookup waits for the resolver's timeout)"""
    got = in_dark(dark_dns, """
        import socket
        print(json.dumps(attempt(lambda: socket.getaddrinfo("store.example", None))))
    """)
    assert got["error"] == "gaierror" and got["took"] > RESOLVER_S * 0.8, got


def test_group_create_gives_up_on_a_store_name_at_its_deadline(dark_dns):
    """(before: Group.create waited the resolver's 12 s, past its 2 s timeout, then said the
    host "does not resolve")"""
    got = in_dark(dark_dns, """
        print(json.dumps(attempt(lambda: ctrlcomm.Group.create(
            "store.example", free_port(), 0, 1, name="dark", timeout=2))))
    """)
    assert got["error"] == "FormationStoreTimeoutError", got
    assert got["formation"] and got["store"] and got["answered"] is False, got
    assert "'store.example'" in got["msg"] and "rank 0" in got["msg"], got
    assert got["took"] < 2 + 5, got


def test_a_store_client_gives_up_on_a_name_at_its_timeout(dark_dns):
    got = in_dark(dark_dns, """
        print(json.dumps(attempt(lambda: ctrlcomm.StoreClient("store.example", free_port(),
                                                              timeout=2))))
    """)
    assert got["error"] == "StoreTimeoutError" and got["answered"] is False, got
    assert "'store.example'" in got["msg"], got
    assert got["took"] < 2 + 5, got


def test_a_store_server_gives_up_on_a_name_at_its_lookup_timeout(dark_dns):
    """(before: ZeroMQ's bind() looked the name up itself, for the resolver's 12 s)"""
    got = in_dark(dark_dns, """
        print(json.dumps(attempt(lambda: ctrlcomm.StoreServer("store.example", 0,
                                                              lookup_timeout=2))))
    """)
    assert got["error"] == "StoreTimeoutError" and got["store"], got
    assert "store.example" in got["msg"], got
    assert got["took"] < 2 + 5, got


def test_a_bind_host_name_is_looked_up_within_formation_deadline(dark_dns):
    """(the store on a number, the rank's bind_host a name; and a group formed right after
    in the same process, on numbers, is not held up by the lookup left behind)"""
    got = in_dark(dark_dns, """
        late = attempt(lambda: ctrlcomm.Group.create(
            "127.0.0.1", free_port(), 0, 1, name="dark", timeout=2, bind_host="me.example"))

        def formed():
            with ctrlcomm.Group.create("127.0.0.1", free_port(), 0, 1, timeout=5) as g:
                assert g.all_reduce(2) == 2
        late["after"] = attempt(formed)
        print(json.dumps(late))
    """)
    assert got["error"] == "FormationTimeoutError" and got["formation"], got
    assert "bind_host" in got["msg"] and "'me.example'" in got["msg"], got
    assert got["took"] < 2 + 5, got
    assert got["after"]["error"] is None and got["after"]["took"] < 5, got


def test_a_name_the_hosts_file_gives_as_ipv6_loopback_alone_reaches_an_ipv4_store(dark_dns):
    """(before, after the first version of the deadline: the name was looked up for any
    family, which gives "::1", where the store, started on the same name by ZeroMQ, listens
    on 127.0.0.1; ranks that spelled the host differently no longer met)"""
    got = in_dark(dark_dns, """
        srv = ctrlcomm.StoreServer("ip6-localhost", 0)  # (ZeroMQ looks the name up)

        def client():
            c = ctrlcomm.StoreClient("ip6-localhost", srv.port, timeout=5)
            c.set("k", b"v")
            assert ctrlcomm.StoreClient("127.0.0.1", srv.port, timeout=5).get("k") == b"v"

        def group():
            with ctrlcomm.Group.create("ip6-localhost", srv.port, 0, 1, timeout=5,
                                       host_store=False) as g:
                assert g.all_reduce(1) == 1
        print(json.dumps({"client": attempt(client), "group": attempt(group)}))
    """)
    assert got["client"]["error"] is None and got["group"]["error"] is None, got


def test_from_env_under_torchrun_gives_up_on_a_master_name_at_its_deadline(dark_dns):
    """(before: torch's TCPStore looked MASTER_ADDR up first, without a deadline: the
    resolver's 12 s, past from_env's 2 s)"""
    pytest.importorskip("torch")
    got = in_dark(dark_dns, """
        import os
        import torch.distributed  # (imported before the clock starts)
        os.environ.update(MASTER_ADDR="store.example", MASTER_PORT=str(free_port()), RANK="1",
                          WORLD_SIZE="2", TORCHELASTIC_USE_AGENT_STORE="True",
                          TORCHELASTIC_RESTART_COUNT="0")
        print(json.dumps(attempt(lambda: ctrlcomm.Group.from_env(name="dark", timeout=2))))
    """)
    assert got["error"] == "FormationStoreTimeoutError" and got["store"], got
    assert "'store.example'" in got["msg"] and "agent" in got["msg"], got
    assert got["took"] < 2 + 5, got


def test_from_torch_gives_up_on_a_hostname_at_its_deadline(dark_dns):
    pytest.importorskip("torch")
    got = in_dark(dark_dns, """
        import os
        import torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        out = attempt(lambda: ctrlcomm.Group.from_torch(hostname="store.example", timeout=2))
        dist.destroy_process_group()
        print(json.dumps(out))
    """)
    assert got["error"] == "FormationTimeoutError" and got["formation"], got
    assert "hostname" in got["msg"] and "'store.example'" in got["msg"], got
    assert got["took"] < 2 + 5, got


def test_a_name_the_hosts_file_gives_an_ipv6_address_alone_resolves_while_dns_is_down(
        dark_dns):
    """(before: the IPv4 query, which goes on to the DNS, failed "temporarily", and the
    query for any family, which the hosts file answers, was not made)"""
    got = in_dark(dark_dns, """
        import socket
        from ctrlcomm.transport._net import resolve
        ipv4 = attempt(lambda: socket.getaddrinfo("down.v6only.example", None,
                                                  socket.AF_INET))

        def group():
            with ctrlcomm.Group.create("down.v6only.example", free_port(), 0, 1,
                                       timeout=5) as g:
                assert g.all_reduce(1) == 1
        print(json.dumps({"ipv4": ipv4, "address": resolve("down.v6only.example", 5),
                          "group": attempt(group)}))
    """)
    assert got["ipv4"]["error"] == "gaierror" and got["ipv4"]["took"] < 2, got  # (SERVFAIL)
    assert got["address"] == V6_ONLY and got["group"]["error"] is None, got
