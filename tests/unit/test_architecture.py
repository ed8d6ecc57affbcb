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



def test_no_module_imports_itself_back():
    """No import cycle among ctrlcomm's modules (lazy imports too; not the type checker's)."""
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter")
    g = grimp.build_graph("ctrlcomm", exclude_type_checking_imports=True)
    adj = {m: sorted(x for x in g.find_modules_directly_imported_by(m)
                     if x.startswith("ctrlcomm")) for m in g.modules}
    done, path, cycles = set(), [], []

    def visit(m):
        path.append(m)
        for n in adj[m]:
            if n in path:
                cycles.append(path[path.index(n):] + [n])
            elif n not in done:
                visit(n)
        path.pop()
        done.add(m)

    for m in sorted(adj):
        if m not in done:
            visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)
