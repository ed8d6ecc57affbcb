"""`ctrlcomm bench` runs, compares and writes what it says it writes (tiny iteration counts)."""

import json
import subprocess
import sys

import pytest


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "ctrlcomm", "bench", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_bench_local_with_aio_json_and_comparison(tmp_path):
    out = tmp_path / "r.json"
    p = run("-n", "2", "--ops", "barrier,all_reduce,broadcast,send_recv", "--sizes", "8,1K",
            "--iters", "20", "--warmup", "2", "--aio", "--against", "store",
            "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "ctrlcomm-aio" in p.stdout and "store" in p.stdout
    rows = json.loads(out.read_text())["results"]
    systems = {r["system"] for r in rows}
    assert {"ctrlcomm", "ctrlcomm-aio", "store"} <= systems
    for r in rows:
        assert r["median_us"] > 0 and r["p99_us"] >= r["median_us"] and 0 <= r["cpu_frac"] < 1.5
    again = run("--from-json", str(out))
    assert again.returncode == 0 and "barrier" in again.stdout


def test_bench_rejects_unknown_ops_and_systems():
    assert run("--ops", "allreduce").returncode == 2
    assert run("--against", "nccl").returncode == 2
