import inspect
import multiprocessing
import os
import signal

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    # Started in the background by a shell without job control (`cmd &`, nohup), the
    # suite ignores SIGINT, and so would every process it starts (an ignored signal stays
    # ignored across exec): the tests of Ctrl-C (a rank interrupted, the bench stopped)
    # would test nothing and fail. They need it as a terminal gives it.
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Ranks start as forks of ctrlcomm.testing's server, which has imported ctrlcomm (see
# run_ranks); each imports its test's module, and so pytest: imported there once too (0.2 s
# of every rank's start otherwise). ("__main__": multiprocessing's own default.)
multiprocessing.set_forkserver_preload(["__main__", "pytest"])


@pytest.fixture
def store():
    """A store server on a free loopback port, served from the test process."""
    from ctrlcomm import StoreServer

    with StoreServer("127.0.0.1", 0) as srv:
        yield srv




# The tests whose outcome depends on an optional or runtime dependency's behaviour, marked
# with its name: scripts/test runs them a second time against the lowest versions
# pyproject.toml admits (.ci/lowest.txt). A test depends on pyzmq (the zmq transport,
# CurveZMQ, and the store, which runs over ZeroMQ whatever the transport) where its module
# is one of those below or its id or code says so, as for the others; a test parametrized
# with another transport or codec does not.
_ZEROMQ_MODULES = {"test_store.py", "test_encryption.py", "test_security.py", "test_transport.py"}
_WORDS = {
    "zeromq": ("zmq", "zeromq", "curve", "encrypt"),
    "msgpack": ("msgpack",),
    "plot": ("matplotlib", "--plot"),
    "mpi": ("mpi4py", '"mpi"', ",mpi", "mpi,"),
    "docs": ("mkdocs",),
}


def _source(item):
    try:
        return inspect.getsource(item.function).lower()
    except (AttributeError, OSError, TypeError):
        return ""


def pytest_collection_modifyitems(config, items):
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        text = item.nodeid.lower() + _source(item)
        marks = {m for m, words in _WORDS.items() if any(w in text for w in words)}
        if params.get("transport", "zmq") != "zmq":
            marks.discard("zeromq")
        if params.get("codec", "msgpack") != "msgpack":
            marks.discard("msgpack")
        if item.path.name in _ZEROMQ_MODULES:
            marks.add("zeromq")
        for m in marks:
            item.add_marker(getattr(pytest.mark, m))
