"""encrypt=True: CurveZMQ on every group and store connection, keys through the store.

The capture tests read every packet on the loopback interface (a raw AF_PACKET socket, so
root) while a group sends a marker: without encryption the marker is on the wire (the
capture works), with it nowhere."""

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

import ctrlcomm
from ctrlcomm.testing import free_port, run_group

KEY = "curve-test-key"
MARKER = "MARKER-7f3a9c-" * 8


def chatty(g):
    g.store.set("secret-in-store", MARKER)  # store traffic
    out = [g.broadcast({"m": MARKER} if g.rank == 0 else None, src=0),
           g.all_gather(g.rank), g.all_reduce([g.rank, 1], op="max")]
    if g.rank == 1:
        g.send(MARKER, dst=0)
    if g.rank == 0:
        out.append(g.recv(1))
    out.append(g.store.get("secret-in-store").decode())
    out.append(g.stats()["transport"])
    g.barrier()
    return out


class Capture:
    """Every byte sent on the loopback interface while it runs."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.1)
        self.data = bytearray()
        self.stop = False
        self.t = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop:
            try:
                self.data += self.sock.recv(65536)
            except TimeoutError:
                pass

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *exc):
        time.sleep(0.2)
        self.stop = True
        self.t.join()
        self.sock.close()


def captured(group_kwargs):
    with Capture() as cap:
        res = run_group(chatty, 2, group_kwargs=group_kwargs)
    return res, bytes(cap.data)


@pytest.mark.skipif(os.geteuid() != 0, reason="capturing loopback packets needs root")
@pytest.mark.parametrize("encrypt", [False, True])
def test_nothing_readable_on_the_wire_when_encrypted(encrypt):
    kw = {"auth_key": KEY, "encrypt": True} if encrypt else \
        {"auth_key": KEY, "transport": "zmq"}
    res, wire = captured(kw)
    r0, r1 = res
    assert r0[0] == r1[0] == {"m": MARKER}
    assert r0[1] == [0, 1] and r0[2] == [1, 1]
    assert r0[3] == MARKER and r0[4] == r1[3] == MARKER
    assert r0[5] == "zmq"
    if encrypt:
        assert MARKER[:14].encode() not in wire
    else:
        assert wire.count(MARKER[:14].encode()) >= 3  # the capture sees plain traffic


def several(g):
    return (g.all_reduce(g.rank), g.scatter([1, 2, 3] if g.rank == 0 else None),
            g.all_to_all([g.rank] * 3), g.stats()["transport"])


def test_encrypt_runs_every_collective_and_defaults_to_zmq():
    res = run_group(several, 3, group_kwargs={"auth_key": KEY, "encrypt": True})
    assert [r[0] for r in res] == [3, 3, 3]
    assert [r[1] for r in res] == [1, 2, 3]
    assert res[2][2] == [0, 1, 2] and {r[3] for r in res} == {"zmq"}


def test_encrypt_needs_a_key_and_zeromq():
    port = free_port()
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="auth_key"):
        ctrlcomm.Group.create("127.0.0.1", port, 0, 1, encrypt=True)
    with pytest.raises(ctrlcomm.InvalidArgumentError, match="transport='tcp'"):
        ctrlcomm.Group.create("127.0.0.1", port, 0, 1, encrypt=True, auth_key=KEY,
                              transport="tcp")


def test_unencrypted_client_gets_nothing_from_an_encrypted_store():
    from ctrlcomm import StoreClient
    from ctrlcomm.rendezvous._server import StoreServer

    with StoreServer("127.0.0.1", 0, auth_key=KEY, encrypt=True) as srv:
        good = StoreClient("127.0.0.1", srv.port, auth_key=KEY, encrypt=True, timeout=5)
        good.set("k", "v")
        assert good.get("k") == b"v"
        plain = StoreClient("127.0.0.1", srv.port, auth_key=KEY, timeout=0.5)
        with pytest.raises(ctrlcomm.StoreTimeoutError):
            plain.get("k")
        wrong = StoreClient("127.0.0.1", srv.port, auth_key="other", encrypt=True, timeout=0.5)
        with pytest.raises(ctrlcomm.StoreTimeoutError, match="encryption"):
            wrong.get("k")
        for c in (good, plain, wrong):
            c.close()


def test_store_cli_encrypt_needs_a_key():
    env = {k: v for k, v in os.environ.items() if k != "CTRLCOMM_AUTH_KEY"}
    p = subprocess.run([sys.executable, "-m", "ctrlcomm", "store", "--encrypt", "--port",
                        str(free_port())], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "CTRLCOMM_AUTH_KEY" in p.stderr
