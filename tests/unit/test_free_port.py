"""ctrlcomm.testing.free_port: a port outside the range outgoing connections take theirs from."""

import errno
import socket

import pytest

from ctrlcomm.testing import _runner, free_port


def test_free_port_is_outside_the_ephemeral_range_and_bindable():
    low, high = _runner._ephemeral_range()
    if not _runner._candidates(low, high):
        pytest.skip(f"no room outside the ephemeral range {low}-{high}")
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # picked at random, not one fixed port
    for port in ports:
        assert not low <= port <= high, (port, low, high)
        assert not any(port in r for r in _runner._AVOID), port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_candidates_below_and_above_the_range():
    assert _runner._candidates(32768, 60999) == [range(10000, 32768), range(61000, 65536)]
    assert _runner._candidates(1024, 65535) == []  # no room: the OS picks
    assert _runner._candidates(0, 0) == []


def _free_below_range():
    for port in range(12000, 13000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.skip("no free port in 12000-13000")


def test_free_port_skips_a_port_in_use_and_ports_to_avoid(monkeypatch):
    good = _free_below_range()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        offered = iter([busy, 30500, good])
        monkeypatch.setattr(_runner, "_ephemeral_range", lambda: (40000, 50000))
        monkeypatch.setattr(_runner, "_random_port", lambda spans: next(offered))
        assert free_port() == good  # not the busy one, not the NodePort one


def test_free_port_raises_at_once_what_is_not_a_matter_of_the_port(monkeypatch):
    binds = []

    class NotLocal(socket.socket):
        def bind(self, address):
            binds.append(address)
            raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")

    monkeypatch.setattr(_runner.socket, "socket", NotLocal)
    with pytest.raises(OSError, match="Cannot assign") as e:
        free_port()
    assert e.value.errno == errno.EADDRNOTAVAIL and len(binds) == 1


def test_free_port_on_ipv6_loopback():
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback")
    port = free_port("::1")
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", port))


def test_free_port_without_a_readable_range_asks_the_os(monkeypatch):
    monkeypatch.setattr(_runner, "_ephemeral_range", lambda: (0, 0))

    def no_pick(spans):
        raise AssertionError("picked a port itself")

    monkeypatch.setattr(_runner, "_random_port", no_pick)
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
