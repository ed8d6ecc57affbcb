"""The ranges pyproject.toml admits are the ranges CI tests: each runtime dependency's lower
bound is the version scripts/test's second run installs (.ci/lowest.txt; torch: its one pin)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the test extra's tools: tested at their newest only (they change no result of ctrlcomm's)
TOOLS = {"pytest", "pytest-timeout", "hypothesis", "atheris", "ruff", "mypy", "import-linter"}

tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")


def requirements():
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    return [r for r in map(Requirement, reqs) if r.name not in TOOLS]


def pins():
    """name -> version, from .ci/lowest.txt and scripts/test's torch pin."""
    out = {}
    for line in (ROOT / ".ci" / "lowest.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            out[name.strip()] = version.strip()
    torch = re.findall(r"torch==([\w.]+)", (ROOT / "scripts" / "test").read_text())
    assert len(set(torch)) == 1, torch
    out["torch"] = torch[0]
    return out


def test_every_runtime_dependency_has_a_lower_bound_that_ci_installs():
    from packaging.version import Version

    pinned = pins()
    seen = set()
    for req in requirements():
        lower = [s.version for s in req.specifier if s.operator == ">="]
        assert len(lower) == 1, f"{req}: give one '>=' bound (the lowest version CI tests)"
        assert req.name in pinned, f"{req.name} has no pin in .ci/lowest.txt"
        assert Version(pinned[req.name]) == Version(lower[0]), \
            f"{req}: .ci/lowest.txt (or scripts/test) installs {pinned[req.name]}"
        seen.add(req.name)
    assert set(pinned) <= seen, f"pins of nothing pyproject.toml asks for: {set(pinned) - seen}"
