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
