"""The code's shape, checked as CI runs the tests: the layers import one way only (the
import-linter contracts in pyproject.toml), ruff's rules with a bound on complexity (C901),
and mypy strict on src/."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent


def tool(name):
    path = BIN / name
    if not path.exists():
        path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (the test extra installs it)")
    return str(path)


def run(*cmd, timeout=600):
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout + r.stderr


def test_the_layers_import_one_way_only():
    rc, out = run(tool("lint-imports"), "--no-cache")
    assert rc == 0, out
    assert "0 broken" in out, out


def test_ruff_passes_with_the_complexity_bound():
    rc, out = run(tool("ruff"), "check", "src", "tests", "benchmarks", "fuzz", "--no-cache")
    assert rc == 0, out


def test_mypy_strict_passes_on_src():
    rc, out = run(tool("mypy"), "--no-incremental", timeout=900)
    assert rc == 0, out

