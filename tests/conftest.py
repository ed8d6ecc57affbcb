import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture
def store():
    """A store server on a free loopback port, served from the test process."""
    from ctrlcomm import StoreServer

    with StoreServer("127.0.0.1", 0) as srv:
        yield srv
