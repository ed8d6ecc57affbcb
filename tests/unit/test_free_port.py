"""ctrlcomm.testing.free_port: a port outside the range outgoing connections take theirs from."""

import socket

from ctrlcomm.testing import _runner, free_port


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    low = _runner._ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # picked at random, not one fixed port
    for port in ports:
        if low > 11000:
            assert 10000 <= port < low, (port, low)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_port_skips_a_port_in_use(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        taken.listen()

        class Fixed:
            calls = 0

            def randrange(self, a, b):
                Fixed.calls += 1
                return busy if Fixed.calls == 1 else a + 7

        monkeypatch.setattr(_runner.random, "SystemRandom", Fixed)
        monkeypatch.setattr(_runner, "_ephemeral_low", lambda: max(busy + 1, 20000))
        port = free_port()
        assert port != busy and Fixed.calls == 2


def test_free_port_without_a_readable_range_asks_the_os(monkeypatch):
    monkeypatch.setattr(_runner, "_ephemeral_low", lambda: 0)
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
