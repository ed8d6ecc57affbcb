"""What the tests that make network namespaces share (root and iproute2)."""

import os
import shutil
import subprocess

import pytest

MARKS = [
    pytest.mark.multihost,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                       reason="needs root and iproute2 to make network namespaces"),
]


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)
