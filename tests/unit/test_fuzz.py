"""Run the coverage-guided fuzzer for a bounded number of inputs (CI has atheris)."""

import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parents[2] / "fuzz" / "fuzz_wire.py"


@pytest.mark.slow
def test_atheris_finds_no_crash(tmp_path):
    pytest.importorskip("atheris")
    p = subprocess.run([sys.executable, str(FUZZ), "-runs=30000", f"-artifact_prefix={tmp_path}/"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Done 30000 runs" in p.stderr
