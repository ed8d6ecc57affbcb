"""`ctrlcomm bench` runs, compares and writes what it says it writes (tiny iteration counts)."""

import json
import os
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
        # process CPU counts every thread (heartbeats, ZeroMQ's I/O thread): over a few
        # short calls it can exceed the wall time, never the wall time on every CPU
        assert r["median_us"] > 0 and r["p99_us"] >= r["median_us"]
        assert 0 <= r["cpu_frac"] <= (os.cpu_count() or 1) + 0.5
    again = run("--from-json", str(out))
    assert again.returncode == 0 and "barrier" in again.stdout


def test_bench_rejects_unknown_ops_and_systems():
    assert run("--ops", "allreduce").returncode == 2
    assert run("--against", "nccl").returncode == 2


def test_bench_repeat_pools_the_samples_of_alternating_runs(tmp_path):
    out = tmp_path / "r.json"
    p = run("-n", "2", "--ops", "barrier,all_reduce", "--iters", "15", "--warmup", "2",
            "--repeat", "2", "--aio", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "4/4" not in p.stderr and "8/8" in p.stderr  # 2 ops x 2 systems x 2 runs
    data = json.loads(out.read_text())
    assert data["config"]["repeat"] == 2
    assert {(r["system"], r["op"]) for r in data["results"]} == {
        (s, o) for s in ("ctrlcomm", "ctrlcomm-aio") for o in ("barrier", "all_reduce")}
    for r in data["results"]:  # and each run's own median beside the pooled one
        assert len(r["repeat_median_us"]) == 2 and all(m > 0 for m in r["repeat_median_us"])
        assert min(r["repeat_median_us"]) <= r["median_us"] <= max(r["repeat_median_us"])


def test_merge_appends_samples_and_weights_cpu():
    from ctrlcomm._bench import merge, summarize

    a = [{("barrier", 0): {"times": [1.0, 2.0], "cpu": 1.0}}] * 2
    b = [{("barrier", 0): {"times": [3.0, 4.0, 5.0, 6.0], "cpu": 4.0}}] * 2
    m = merge(a, b)
    assert m[0][("barrier", 0)] == {"times": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], "cpu": 3.0}
    assert summarize(m)[("barrier", 0)]["median_us"] == 3.5e6


def _threads_numpy_adds() -> int:
    before = len(os.listdir("/proc/self/task"))
    import numpy  # noqa: F401

    return len(os.listdir("/proc/self/task")) - before


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_bench_ranks_start_numpy_without_a_thread_pool():
    # A numpy import starts OpenBLAS workers that spin ~0.1 s; in a rank they took the CPUs
    # of the ranks and counted as the rank's CPU (cpu_frac 2-3 on two CPUs). Ranks are
    # spawned inside one_thread_pools(): there numpy starts no thread.
    import concurrent.futures
    import multiprocessing as mp

    pytest.importorskip("numpy")
    from ctrlcomm import _bench

    def spawned() -> int:
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
            return ex.submit(_threads_numpy_adds).result(timeout=60)

    if spawned() == 0:  # (one CPU, a numpy without a pool, or the user set the variables)
        pytest.skip("numpy starts no thread here: nothing to check")
    with _bench.one_thread_pools():
        assert spawned() == 0


def test_one_thread_pools_keeps_what_the_user_set(monkeypatch):
    from ctrlcomm import _bench

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    with _bench.one_thread_pools():
        assert os.environ["OMP_NUM_THREADS"] == "3"
        assert os.environ["OPENBLAS_NUM_THREADS"] == "1"
    assert os.environ["OMP_NUM_THREADS"] == "3"
    assert "OPENBLAS_NUM_THREADS" not in os.environ
