"""`ctrlcomm bench` runs, compares and writes what it says it writes (tiny iteration counts)."""

import json
import os
import subprocess
import sys

import pytest


def run(*args, timeout=300, env=None, default_against=False):
    """``ctrlcomm bench ARGS``; a local run compares with nothing unless the test asks for
    --against, or for its default (``default_against``: what is installed)."""
    if "-n" in args and not {"--against", "--from-json", "--formation", "--host"} & set(args) \
            and not default_against:
        args = (*args, "--against", "none")
    return subprocess.run([sys.executable, "-m", "ctrlcomm", "bench", *args], capture_output=True,
                          text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


def multihost(args_by_rank, timeout):
    """Start ``ctrlcomm bench`` once per rank (in the dict's order), as on separate hosts;
    returns the processes and their (stdout, stderr), in that order."""
    procs = [subprocess.Popen([sys.executable, "-m", "ctrlcomm", "bench", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args in args_by_rank.values()]
    try:
        return procs, [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


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
        # every rank's own time is at most its iteration's slowest
        assert 0 < r["median_all_us"] <= r["median_us"] and r["p99_all_us"] <= r["p99_us"]
        assert 0 <= r["cpu_frac"] <= (os.cpu_count() or 1) + 0.5
        # and per rank, in rank order: their mean is the figure above
        for each, mean in (("cpu_us_per_rank", "cpu_us"), ("cpu_frac_per_rank", "cpu_frac")):
            assert len(r[each]) == r["world_size"] and all(v >= 0 for v in r[each])
            assert sum(r[each]) / len(r[each]) == pytest.approx(r[mean])
    again = run("--from-json", str(out))
    assert again.returncode == 0 and "barrier" in again.stdout


def test_the_table_says_what_its_columns_are_and_keeps_them_apart():
    """(before: no word on what "x" is; a ratio under 0.05 shown as 0.0x; past 6 digits of
    us the figures ran together: "3796462.2us6002479us1918108us"; p99 with no decimal
    beside a median with one, 17us beside 17.5us)"""
    from ctrlcomm.bench._run import fmt_ratio, fmt_us, table

    assert [fmt_us(v) for v in (17.5, 999.94, 999.96, 3796462.2, 6002479.0)] == \
        ["17.5us", "999.9us", "1.00ms", "3.80s", "6.00s"]
    assert [fmt_ratio(r) for r in (0.019, 0.64, 1.0, 4.25, 9.96, 179.3)] == \
        ["0.019x", "0.64x", "1.0x", "4.2x", "10x", "179x"]
    row = {"op": "broadcast", "size": 2**30, "world_size": 2}
    rows = [dict(row, system="ctrlcomm", median_us=3796462.2, p99_us=6002479.0,
                 cpu_us=1918108.0),
            dict(row, system="mpi", median_us=60000.0, p99_us=70000.0, cpu_us=50000.0)]
    text = table(rows, ["ctrlcomm", "mpi"])
    line = next(ln for ln in text.splitlines() if ln.startswith("broadcast"))
    assert line.split() == ["broadcast", "1G", "2", "|", "3.80s", "6.00s", "1.92s", "|",
                            "60.00ms", "70.00ms", "50.00ms", "0.016x"], line
    assert "x: that system's median over ctrlcomm's (above 1: ctrlcomm is faster)" in \
        " ".join(text.split())


def test_the_json_says_how_the_run_was_made(tmp_path):
    """(before: no command line, no versions of ctrlcomm or of the baselines' libraries)"""
    out = tmp_path / "r.json"
    p = run("-n", "2", "--ops", "barrier", "--iters", "3", "--warmup", "0", "--json", str(out))
    assert p.returncode == 0, p.stderr
    cfg = json.loads(out.read_text())["config"]
    assert cfg["command"] == f"ctrlcomm bench -n 2 --ops barrier --iters 3 --warmup 0 " \
        f"--json {out} --against none"
    import zmq

    import ctrlcomm

    assert cfg["versions"]["ctrlcomm"] == ctrlcomm.__version__
    assert cfg["versions"]["pyzmq"] == zmq.__version__ and "libzmq" in cfg["versions"]
    again = tmp_path / "again.json"
    assert run("--from-json", str(out), "--json", str(again)).returncode == 0
    assert json.loads(again.read_text())["config"]["command"] == cfg["command"]


def test_star_with_nothing_to_run_is_skipped_saying_why(tmp_path):
    """(before: its ranks were started for nothing, and its column left out without a word)"""
    p = run("-n", "2", "--ops", "barrier", "--iters", "3", "--warmup", "0", "--against",
            "star")
    assert p.returncode == 0, p.stderr
    assert "skipping star: it runs only all_reduce of a few ints" in p.stderr, p.stderr
    assert "star" not in p.stdout.splitlines()[0]


def test_a_mistyped_algorithm_choice_is_refused_not_run_as_the_default():
    """(before: CTRLCOMM_ALGO=all_reduce=dubling ran the default algorithm, and the run
    recorded the setting as if it had been used)"""
    p = run("-n", "2", "--ops", "all_reduce", "--iters", "3",
            env={"CTRLCOMM_ALGO": "all_reduce=dubling"})
    assert p.returncode == 2
    assert "'dubling' is not an algorithm of all_reduce (flat, star, doubling)" in p.stderr
    assert "refused" in p.stderr and "(ignored)" not in p.stderr  # (it said both)


def test_a_mistyped_algorithm_choice_is_warned_of_once_as_a_group_first_plans_a_call():
    """In a library call: a RuntimeWarning once, as the first collective is planned, and
    the default runs; none at import (the bench, which refuses it, printed it too)."""
    code = (
        "import warnings, ctrlcomm\n"
        "from ctrlcomm.testing import free_port\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    import ctrlcomm._algo\n"
        "    assert not seen, seen\n"
        "    g = ctrlcomm.Group.create('127.0.0.1', free_port(), 0, 1, timeout=10)\n"
        "    g.barrier(); g.all_reduce(1); g.barrier()\n"
        "    g.close()\n"
        "msgs = [str(w.message) for w in seen if w.category is RuntimeWarning]\n"
        "assert len(msgs) == 1 and \"'dubling' is not an algorithm\" in msgs[0], msgs\n"
        "print('ok')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "CTRLCOMM_ALGO": "all_reduce=dubling"})
    assert p.stdout.strip() == "ok", p.stderr


def test_bench_rejects_unknown_ops_and_systems():
    assert run("--ops", "allreduce").returncode == 2
    assert run("--against", "nccl").returncode == 2
    p = run("--rank", "0", "--world-size", "2")  # multi-host mode without --host/--port
    assert p.returncode == 2 and "--host" in p.stderr


@pytest.mark.parametrize(("args", "named"), [
    (("-n", "0"), "-n"), (("-n", "2,x"), "-n"), (("--iters", "0"), "--iters"),
    (("--warmup", "-1"), "--warmup"), (("--repeat", "0"), "--repeat"),
    (("--sizes", "1X"), "'1X'"), (("--sizes", "-8"), "'-8'"), (("--ops", ","), "ops"),
    (("--host", "127.0.0.1", "--port", "0", "--rank", "0", "--world-size", "2"), "--port"),
    (("--host", "127.0.0.1", "--port", "29999", "--rank", "2", "--world-size", "2"), "--rank 2"),
    (("--host", "127.0.0.1", "--port", "29999", "--rank", "-1", "--world-size", "2"), "--rank"),
    # any multi-host setting means one rank of a multi-host run, never a local run instead
    (("--host", "127.0.0.1", "--port", "29999", "--world-size", "2"), "missing: --rank"),
    (("--host", "127.0.0.1",), "missing: --port --rank --world-size"),
    (("--world-size", "2",), "missing: --host --port --rank"),
    (("-n", "2", "--host", "127.0.0.1", "--port", "29999", "--rank", "0", "--world-size", "2"),
     "-n runs local ranks"),
    (("--host", "127.0.0.1", "--port", "29999", "--rank", "0", "--world-size", "2", "--against",
      "store"), "--against runs only with local ranks (-n), not in a multi-host run"),
    (("--sizes", "0"), "'0'"), (("--sizes", "0.1"), "'0.1'"), (("--sizes", "1.5"), "'1.5'"),
    (("-n", "1", "--plot", "r.txt"), "--plot r.txt: matplotlib cannot write .txt"),
    (("-n", "1", "--json", "/tmp"), "--json /tmp: cannot write there"),
    (("--from-json", "r.json", "-n", "8", "--iters", "7", "--aio"),
     "-n --iters --aio do not go with it"),
    (("--from-json", "r.json", "--warmup", "0", "--rank", "0"), "--warmup --rank do not go"),
    (("-n", "1", "--plot", "r.pgf"), "--plot r.pgf: matplotlib cannot write .pgf"),
    (("--from-json", "/nonexistent/r.json"), "/nonexistent/r.json"),
    (("-n", "1", "--json", "/nonexistent/r.json"), "--json /nonexistent/r.json"),
    (("-n", "1", "--plot", "/nonexistent/r.png"), "--plot /nonexistent/r.png"),
    # a folder whose permissions allow it, where no file can be made (it ran, then failed)
    (("-n", "1", "--json", "/proc/r.json"), "--json /proc/r.json: cannot write there"),
    (("-n", "1", "--json", "r.out", "--plot", "./r.out"), "name the same file (r.out)"),
    # more than a message carries: each rank failed it, after the ranks had started
    (("-n", "2", "--ops", "broadcast", "--sizes", "8,2G"),
     "--sizes 2G: a payload of 2,147,483,648 bytes is too large at world size 2: broadcast "
     "puts it in one message"),
    (("-n", "2,4", "--ops", "barrier,all_gather", "--sizes", "600M"),
     "at world size 4: all_gather puts 4 of them in one message"),
])
def test_bench_rejects_bad_settings_naming_them_before_it_runs_anything(args, named):
    p = run(*args, timeout=60)
    assert p.returncode == 2, p.stderr
    assert named in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_bench_from_json_rejects_what_a_run_did_not_write(tmp_path):
    row = {"system": "ctrlcomm", "op": "barrier", "size": 0, "world_size": 2,
           "median_us": 10.0, "p99_us": 20.0, "cpu_us": 5.0}
    bad_values = [json.dumps({"results": [dict(row, **{k: v})]}) for k, v in (
        ("median_us", "12"), ("median_us", None), ("median_us", 0), ("size", "8"),
        ("world_size", 0), ("op", "allreduce"), ("cpu_us", -1))]
    for i, text in enumerate(("not json", "{}", '{"results": []}',
                              '{"results": [{"system": "ctrlcomm"}]}', *bad_values)):
        f = tmp_path / f"r{i}.json"
        f.write_text(text)
        p = run("--from-json", str(f), timeout=60)
        assert p.returncode == 2 and str(f) in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_bench_functions_reject_bad_settings_naming_them():
    from ctrlcomm.bench._measure import parse_size
    from ctrlcomm.bench._run import check_cfg, run_local, run_multihost

    ok = {"ops": ["barrier"], "sizes": [8], "iters": 5, "warmup": 0, "repeat": 1}
    check_cfg(ok)
    for change, named in (({"iters": 0}, "iters"), ({"warmup": -1}, "warmup"),
                          ({"repeat": 0}, "repeat"), ({"sizes": [-1]}, "sizes"),
                          ({"ops": ["allreduce"]}, "allreduce"), ({"ops": []}, "ops")):
        with pytest.raises(ValueError, match=named):
            check_cfg({**ok, **change})
    with pytest.raises(ValueError, match="world sizes"):
        run_local([2, 0], ["ctrlcomm"], ok)
    with pytest.raises(ValueError, match="rank 3 of world size 2"):
        run_multihost("127.0.0.1", 29999, 3, 2, ok)
    for text in ("1X", "", "K", "-1", "inf", "1.5.2"):
        with pytest.raises(ValueError, match="payload size"):
            parse_size(text)


OPS4 = ("barrier", "all_reduce", "broadcast", "all_gather")


@pytest.mark.slow
@pytest.mark.torch
def test_bench_against_every_baseline_over_two_world_sizes_with_a_plot(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    from ctrlcomm.bench._baselines import missing

    out, png = tmp_path / "r.json", tmp_path / "r.png"
    p = run("-n", "2,3", "--ops", ",".join(OPS4), "--sizes", "8,1K", "--iters", "6",
            "--warmup", "2", "--against", "gloo,mpi,store", "--json", str(out),
            "--plot", str(png))
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())["results"]
    want = ["ctrlcomm", "gloo", "store", "star"]  # star (Megatron's design) comes with gloo
    if missing("mpi") is None:  # the test command installs mpi4py and MPICH
        want.append("mpi")
    else:
        assert "skipping mpi:" in p.stderr
    assert {r["system"] for r in rows} == set(want)
    total = 7 * 2 * len(want)  # (barrier + 3 ops x 2 sizes) x 2 world sizes x systems
    assert f" {total}/{total} " in p.stderr  # the progress bar ends full (star skips most)
    cells = {(op, size, n) for n in (2, 3) for op in OPS4
             for size in ((0,) if op == "barrier" else (8, 1024))}
    for system in want:
        got = {(r["op"], r["size"], r["world_size"]) for r in rows if r["system"] == system}
        # the star baseline is all_reduce of a few ints only, as Megatron's original
        assert got == {c for c in cells if system != "star" or c[:2] == ("all_reduce", 8)}, \
            system
    for r in rows:
        assert r["median_us"] > 0 and r["p99_us"] >= r["median_us"] and r["cpu_us"] > 0
    # the table: a column group per system, each but ctrlcomm with its ratio to ctrlcomm
    head, _, *lines = p.stdout.splitlines()
    assert all(f"{s} med" in head for s in want)
    barrier2 = next(line for line in lines if line.split()[:3] == ["barrier", "-", "2"])
    assert barrier2.count("x") >= len(want) - 2  # ratios (star has no barrier: n/a)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_bench_skips_a_system_that_is_not_installed_with_a_message(tmp_path):
    # torch and mpi4py made unimportable in the bench's own process (its ranks do not
    # need them): gloo and mpi are skipped, saying why, and ctrlcomm still runs
    code = ("import sys; sys.modules['torch'] = None; sys.modules['mpi4py'] = None; "
            "from ctrlcomm._cli import main; sys.exit(main(sys.argv[1:]))")
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-c", code, "bench", "-n", "2", "--ops", "barrier",
                        "--iters", "5", "--warmup", "1", "--against", "gloo,mpi",
                        "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "skipping gloo: torch is not installed" in p.stderr
    assert "skipping mpi: mpi4py is not installed" in p.stderr
    assert {r["system"] for r in json.loads(out.read_text())["results"]} == {"ctrlcomm"}


@pytest.mark.slow
def test_bench_multihost_mode_one_process_per_rank(tmp_path):
    # each rank started on its own, as on separate hosts (here all on loopback): rank 0
    # hosts the store, gathers every rank's figures, prints the table and writes the JSON
    from ctrlcomm.testing import free_port

    out = tmp_path / "mh.json"
    common = ["--host", "127.0.0.1", "--port", str(free_port()), "--world-size", "3",
              "--ops", "barrier,all_reduce,send_recv", "--iters", "10", "--warmup", "2",
              "--aio", "--repeat", "2"]
    procs, outs = multihost({r: [*common, "--rank", str(r),
                                 *(["--json", str(out)] if r == 0 else [])] for r in (1, 2, 0)},
                            timeout=90)
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    (o1, _), (o2, _), (o0, _) = outs
    assert o1 == o2 == ""  # only rank 0 reports
    assert "ctrlcomm-aio med" in o0 and "send_recv" in o0
    rows = json.loads(out.read_text())["results"]
    assert {(r["system"], r["op"], r["world_size"]) for r in rows} == {
        (s, op, 3) for s in ("ctrlcomm", "ctrlcomm-aio")
        for op in ("barrier", "all_reduce", "send_recv")}
    assert all(r["median_us"] > 0 for r in rows)
    # --repeat: the systems took turns twice, each turn's median beside the pooled one
    assert all(len(r["repeat_median_us"]) == 2 for r in rows)
    cfg = json.loads(out.read_text())["config"]  # (before: like a local run's, no host)
    assert cfg["multihost"] == {"host": "127.0.0.1", "port": int(common[3]), "world_size": 3}
    assert cfg["command"].startswith("ctrlcomm bench --host 127.0.0.1")
    assert "12/12" in outs[2][1]  # rank 0's progress bar: 3 ops x 2 systems x 2 turns
    # each rank says at once that it waits for the others, where, and for how long (rank 0
    # alone with nobody coming waited 300 s in silence)
    port = common[3]
    for r, (_, err) in zip((1, 2, 0), outs, strict=True):
        assert f"rank {r} of 3: waiting for the other ranks at 127.0.0.1:{port} (at most " \
            "300 s)" in err.splitlines()[0], err


def test_bench_multihost_ranks_given_different_world_sizes_both_fail_soon():
    """Rank 0 given --world-size 3 and rank 1 given 2: rank 1 failed at once naming both
    sizes, but rank 0 waited out its whole 300 s deadline for a rank 2 that never comes."""
    from ctrlcomm.testing import free_port

    common = ["--host", "127.0.0.1", "--port", str(free_port()), "--ops", "barrier",
              "--iters", "5", "--warmup", "1"]
    procs, outs = multihost({0: [*common, "--rank", "0", "--world-size", "3"],
                             1: [*common, "--rank", "1", "--world-size", "2"]}, timeout=60)
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 1, err
        assert "FormationError" in err and "rank 0 with world size 3" in err \
            and "rank 1 with world size 2" in err, err


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
    from ctrlcomm.bench._run import merge, summarize

    a = [{("barrier", 0): {"times": [1.0, 2.0], "cpu": 1.0}}] * 2
    b = [{("barrier", 0): {"times": [3.0, 4.0, 5.0, 6.0], "cpu": 4.0}}] * 2
    m = merge(a, b)
    assert m[0][("barrier", 0)] == {"times": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], "cpu": 3.0}
    assert summarize(m)[("barrier", 0)]["median_us"] == 3.5e6
    # per iteration the slowest rank; and, beside it, every rank's own time pooled
    two = [{("barrier", 0): {"times": [1.0, 9.0, 3.0], "cpu": 1.0}},
           {("barrier", 0): {"times": [2.0, 1.0, 5.0], "cpu": 1.0}}]
    fig = summarize(two)[("barrier", 0)]
    assert fig["median_us"] == 5e6 and fig["p99_us"] == 9e6  # of [2, 9, 5]
    assert fig["median_all_us"] == 2.5e6 and fig["p99_all_us"] == 9e6  # of all six


def test_a_ping_pongs_figures_are_those_of_the_two_ranks_that_take_part():
    """send_recv is a ping-pong between ranks 0 and 1: at world 8 the other six ranks' empty
    calls (about 3 us of CPU, 1 us of time) were averaged in (ref25: 21 us of CPU per op
    where ranks 0 and 1 took 95 and 59; median over every rank's time 1 us against 262)."""
    from ctrlcomm.bench._run import summarize

    pair = [{("send_recv", 8): {"times": [4.0, 6.0], "cpu": 2.0}},
            {("send_recv", 8): {"times": [5.0, 5.0], "cpu": 1.0}}]
    idle = [{("send_recv", 8): {"times": [1e-6, 1e-6], "cpu": 1e-6}}] * 6
    fig = summarize(pair + idle)[("send_recv", 8)]
    assert fig["median_us"] == 5.5e6 and fig["median_all_us"] == 5e6  # of [5, 6]; [4, 5, 5, 6]
    assert fig["cpu_us"] == 1.5e6 and fig["cpu_frac"] == pytest.approx((0.4 + 0.2) / 2)
    assert len(fig["cpu_us_per_rank"]) == 8  # every rank's own, still
    # a collective's are every rank's
    every = [{("barrier", 0): d[("send_recv", 8)]} for d in pair + idle]
    assert summarize(every)[("barrier", 0)]["cpu_us"] == pytest.approx((3.0 + 6e-6) / 8 * 1e6)


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
    from ctrlcomm.bench import _measure

    def spawned() -> int:
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
            return ex.submit(_threads_numpy_adds).result(timeout=60)

    if spawned() == 0:  # (one CPU, a numpy without a pool, or the user set the variables)
        pytest.skip("numpy starts no thread here: nothing to check")
    with _measure.one_thread_pools():
        assert spawned() == 0


def test_one_thread_pools_keeps_what_the_user_set(monkeypatch):
    from ctrlcomm.bench import _measure

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    with _measure.one_thread_pools():
        assert os.environ["OMP_NUM_THREADS"] == "3"
        assert os.environ["OPENBLAS_NUM_THREADS"] == "1"
    assert os.environ["OMP_NUM_THREADS"] == "3"
    assert "OPENBLAS_NUM_THREADS" not in os.environ


def test_bench_sizes_parse_as_the_issue_writes_them():
    from ctrlcomm.bench._measure import fmt_size, parse_size

    assert [parse_size(s) for s in ("8", "1K", "64K", "1M", "2MiB", "1.5k", "8B", "1kb")] == [
        8, 1024, 65536, 1 << 20, 2 << 20, 1536, 8, 1024]
    assert [fmt_size(n) for n in (8, 1024, 65536, 1 << 20, 1536)] == ["8", "1K", "64K", "1M",
                                                                     "1536"]


@pytest.mark.slow
def test_bench_runs_every_op_by_default_blocking_and_awaited(tmp_path):
    # no --ops: all eight, each sized one at each size; a world of 3 (not a power of two)
    out = tmp_path / "r.json"
    p = run("-n", "3", "--sizes", "8,64K", "--iters", "5", "--warmup", "1", "--aio",
            "--json", str(out))
    assert p.returncode == 0, p.stderr
    from ctrlcomm.bench._measure import DEFAULT_OPS

    rows = json.loads(out.read_text())["results"]
    assert {(r["system"], r["op"], r["size"]) for r in rows} == {
        (s, op, size) for s in ("ctrlcomm", "ctrlcomm-aio") for op in DEFAULT_OPS
        for size in ((0,) if op == "barrier" else (8, 65536))}
    assert all(r["world_size"] == 3 and r["median_us"] > 0 for r in rows)


def test_a_system_whose_run_fails_is_left_out_and_the_rest_reported(monkeypatch):
    import io
    import subprocess as sp

    from ctrlcomm.bench import _baselines
    from ctrlcomm.bench import _run as _bench

    def broken(n, cfg):
        raise sp.CalledProcessError(1, ["mpiexec", "-n", str(n)])

    monkeypatch.setattr(_baselines, "run_mpi", broken)
    failed, err = {}, io.StringIO()
    cfg = {"ops": ["barrier"], "sizes": [8], "iters": 5, "warmup": 1, "repeat": 2}
    rows = _bench.run_local([2], ["ctrlcomm", "mpi"], cfg, stream=err, failed=failed)
    assert {(r["system"], r["op"]) for r in rows} == {("ctrlcomm", "barrier")}
    assert list(failed) == [("mpi", 2)] and "mpiexec" in failed[("mpi", 2)]
    assert "mpi at 2 ranks failed (left out)" in err.getvalue()
    # the bar ends full: the failed run's steps and the turn it was left out of counted
    # (it stopped at 2/4)
    assert "bench: 4/4 done" in err.getvalue(), err.getvalue()


def test_a_failed_run_is_told_in_a_line_per_rank_without_tracebacks():
    """What each failing rank raised, not 25 lines of the bench's own code per rank."""
    import io

    from ctrlcomm.bench import _run as _bench

    failed, err = {}, io.StringIO()
    cfg = {"ops": ["barrier"], "sizes": [8], "iters": 5, "warmup": 1, "transport": "bogus"}
    assert _bench.run_local([2], ["ctrlcomm"], cfg, stream=err, failed=failed) == []
    text = err.getvalue()
    assert "Traceback" not in text and 'File "' not in text, text
    said = text.split("ctrlcomm at 2 ranks failed (left out):\n", 1)[1].rstrip().splitlines()
    assert len(said) == 2 and said[0].startswith("  rank 0: ") \
        and said[1].startswith("  rank 1: "), said
    # the first to fail says why; the other failed too, or was stopped (either may be first)
    assert any("unknown transport 'bogus'" in s for s in said), said
    assert all("bogus" in s or "failed first" in s for s in said), said
    assert failed[("ctrlcomm", 2)] == "\n".join(said)
    assert "bench: 1/1 done (last: ctrlcomm N=2 failed)" in text, text


def test_the_table_keeps_ctrlcomm_as_its_base_when_ctrlcomm_failed(monkeypatch, capsys,
                                                                    tmp_path):
    from ctrlcomm import _cli
    from ctrlcomm.bench import _baselines
    from ctrlcomm.bench import _run as _bench

    store_row = {"system": "store", "op": "barrier", "size": 0, "world_size": 2,
                 "median_us": 200.0, "p99_us": 300.0, "cpu_us": 50.0, "cpu_frac": 0.3}

    def ran(rows):
        def run_local(world_sizes, systems, cfg, stream=None, failed=None):
            failed[("ctrlcomm", 2)] = "2 of 2 ranks failed: ..."
            return rows
        return run_local

    monkeypatch.setattr(_baselines, "missing", lambda system: None)
    monkeypatch.setattr(_bench, "run_local", ran([store_row]))
    assert _cli.main(["bench", "-n", "2", "--ops", "barrier", "--against", "store"]) == 1
    out, err = capsys.readouterr()
    head, _, line = out.splitlines()[:3]
    assert head.index("ctrlcomm med") < head.index("store med")  # ctrlcomm still the base
    assert "n/a" in line and "200.0us" in line and "x" not in line.split("|")[2]
    assert "left out, their runs failed: ctrlcomm at 2 ranks" in err
    # saved and shown again: the same table and the same line (the failure was forgotten:
    # the store became the base, with no ratio, and nothing said ctrlcomm had failed)
    saved = tmp_path / "r.json"
    assert _cli.main(["bench", "-n", "2", "--ops", "barrier", "--against", "store",
                      "--json", str(saved)]) == 1
    live = capsys.readouterr()
    assert json.loads(saved.read_text())["failed"] == [
        {"system": "ctrlcomm", "world_size": 2, "why": "2 of 2 ranks failed: ..."}]
    assert _cli.main(["bench", "--from-json", str(saved)]) == 0
    shown = capsys.readouterr()
    table = [ln for ln in live.out.splitlines() if not ln.startswith(("ran on", "wrote"))]
    assert [ln for ln in shown.out.splitlines() if not ln.startswith("ran on")] == table
    assert "left out, their runs failed: ctrlcomm at 2 ranks" in shown.err
    # the columns in the run's order, where a system failed at the first world size and ran
    # at the next (its column moved behind the next one's)
    rows = [dict(store_row, system=s, world_size=n) for s, n in
            (("ctrlcomm", 2), ("ctrlcomm", 4), ("gloo", 2), ("gloo", 4), ("store", 4))]

    def store_failed_at_2(world_sizes, systems, cfg, stream=None, failed=None):
        failed[("store", 2)] = "2 of 2 ranks failed: ..."
        return rows

    monkeypatch.setattr(_bench, "run_local", store_failed_at_2)
    assert _cli.main(["bench", "-n", "2,4", "--ops", "barrier", "--against", "store,gloo",
                      "--json", str(saved)]) == 1
    live_head = capsys.readouterr().out.splitlines()[0]
    assert _cli.main(["bench", "--from-json", str(saved)]) == 0
    shown_head = capsys.readouterr().out.splitlines()[0]
    assert shown_head == live_head and live_head.index("store") < live_head.index("gloo")
    monkeypatch.setattr(_bench, "run_local", ran([]))
    assert _cli.main(["bench", "-n", "2", "--ops", "barrier", "--against", "none"]) == 1
    assert "nothing ran" in capsys.readouterr().err


def test_mpiexec_past_its_timeout_is_killed_with_everything_it_started(tmp_path, monkeypatch):
    import subprocess as sp
    import time

    from ctrlcomm.bench import _baselines

    fake = tmp_path / "mpiexec"  # starts a "rank" and waits, as a hung mpiexec would
    fake.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {tmp_path}/rank.pid\nwait\n")
    fake.chmod(0o755)
    monkeypatch.setattr(_baselines, "mpiexec", lambda: str(fake))
    cfg = {"ops": ["barrier"], "sizes": [8], "iters": 1, "warmup": 0, "timeout": 1}
    t = time.monotonic()
    with pytest.raises(sp.TimeoutExpired):
        _baselines.run_mpi(2, cfg)
    assert time.monotonic() - t < 10
    rank = int((tmp_path / "rank.pid").read_text())
    for _ in range(50):  # killed (then reaped by init, as its parent died too)
        try:
            with open(f"/proc/{rank}/stat") as f:
                if f.read().split(") ")[1][0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the rank mpiexec started ({rank}) still runs")


def test_bench_from_json_with_json_writes_the_saved_runs_settings(tmp_path):
    out, again = tmp_path / "r.json", tmp_path / "again.json"
    p = run("-n", "2", "--ops", "barrier", "--iters", "5", "--warmup", "1", "--json", str(out))
    assert p.returncode == 0, p.stderr
    shown = run("--from-json", str(out), "--json", str(again), timeout=60)
    assert shown.returncode == 0, shown.stderr
    saved, copy = json.loads(out.read_text()), json.loads(again.read_text())
    assert copy == saved
    assert saved["config"]["iters"] == 5 and saved["config"]["world_sizes"] == [2]


def test_bench_records_and_shows_the_machine_it_ran_on(tmp_path):
    """Runs on different machines, or with ctrlcomm's choices overridden, can be told apart:
    the JSON records the kernel, the CPU, a Python speed figure before and after the run and
    the overriding variables, and the table is followed by a line saying so, also when a
    saved run is shown again."""
    import platform

    out = tmp_path / "r.json"
    # (with the auth key every group of the run is keyed, the bench's own store too: the
    # ranks refused the unkeyed store it ran, and nothing ran; the key itself is not written)
    p = run("-n", "2", "--ops", "barrier,all_reduce", "--iters", "5", "--warmup", "1",
            "--against", "star", "--json", str(out),
            env={"CTRLCOMM_ALGO": "barrier=star", "CTRLCOMM_AUTH_KEY": "s3cret-k3y"})
    assert p.returncode == 0, p.stderr
    assert "s3cret" not in out.read_text() and "s3cret" not in p.stdout + p.stderr
    data = json.loads(out.read_text())
    assert {(r["system"], r["op"]) for r in data["results"]} == {
        ("ctrlcomm", "barrier"), ("ctrlcomm", "all_reduce"), ("star", "all_reduce")}
    cfg = data["config"]
    host = cfg["host"]
    assert host["kernel"] == f"{platform.system()} {platform.release()}" and host["cpu"]
    assert host["env"] == {"CTRLCOMM_ALGO": "barrier=star", "CTRLCOMM_AUTH_KEY": "(set)"}
    speeds = host["sum_range_1000_us"]
    assert len(speeds) == 2 and all(0 < v < 100_000 for v in speeds)
    assert cfg["python"] == sys.version.split()[0] and cfg["cpus"] == os.cpu_count()
    shown = run("--from-json", str(out), timeout=60)
    for text in (p.stdout, shown.stdout):
        line = next(ln for ln in text.splitlines() if ln.startswith("ran on: "))
        assert platform.release() in line and f"{speeds[0]} and {speeds[1]} us" in line
        assert "CTRLCOMM_ALGO=barrier=star CTRLCOMM_AUTH_KEY=(set)" in line, line
        assert f"Python {cfg['python']}" in line


def test_bench_counts_each_world_size_op_and_size_once_and_names_the_plot_it_writes(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "plot"  # (no extension: a PNG at that name)
    p = run("-n", "2,2", "--ops", "barrier,broadcast,barrier", "--sizes", "8,8", "--iters",
            "3", "--warmup", "0", "--json", str(out), "--plot", str(png))
    assert p.returncode == 0, p.stderr
    keys = [(r["system"], r["op"], r["size"], r["world_size"])
            for r in json.loads(out.read_text())["results"]]
    assert sorted(keys) == [("ctrlcomm", "barrier", 0, 2), ("ctrlcomm", "broadcast", 8, 2)]
    assert f"wrote {png}" in p.stdout and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sizes_that_send_the_same_small_object_run_once_saying_so(tmp_path):
    """Up to 64 bytes every size sends one small object: --sizes 1,8,64 gave three rows of the
    same measurement under three sizes."""
    out = tmp_path / "r.json"
    p = run("-n", "1", "--ops", "broadcast", "--sizes", "1,8,64,1K", "--iters", "3",
            "--warmup", "0", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "--sizes 1, 8, 64: up to 64 bytes every size sends the same small object; " \
        "running 8 only" in p.stderr  # (8: the size the reference runs show)
    assert sorted(r["size"] for r in json.loads(out.read_text())["results"]) == [8, 1024]
    quiet = run("-n", "1", "--ops", "barrier", "--sizes", "8,16", "--iters", "2", "--warmup",
                "0")  # no op that carries a payload: nothing to say
    assert quiet.returncode == 0 and "small object" not in quiet.stderr, quiet.stderr
    assert "the same small object" in " ".join(run("--help").stdout.split())


def test_the_size_check_counts_the_payloads_the_chosen_plan_puts_in_one_message():
    """Refused only what would fail: each op's most payloads in one message, from the plan
    ctrlcomm runs at that world size (it took a gather or all_gather to carry one per rank:
    a 1 GiB gather at world 2, one payload per message, was refused)."""
    from ctrlcomm.bench._run import most_per_message, too_large

    assert [most_per_message("gather", n) for n in (1, 2, 8, 9, 16, 300)] == \
        [0, 1, 1, 4, 8, 128]  # flat up to 8 ranks, then a binomial tree's largest subtree
    assert [most_per_message("all_gather", n) for n in (2, 3, 8, 9, 16)] == [1, 3, 8, 4, 8]
    assert [most_per_message("scatter", n) for n in (4, 9)] == [1, 4]
    assert most_per_message("broadcast", 8) == most_per_message("all_reduce", 64) == 1
    assert most_per_message("barrier", 8) == 0
    g = 1 << 30
    assert too_large(["gather", "all_gather", "scatter"], [g], [2]) is None
    assert too_large(["broadcast"], [3 * g], [1]) is None  # nothing sent
    why = too_large(["barrier", "gather"], [8, 300 << 20], [8, 16])
    assert why is not None and "at world size 16: gather puts 8 of them in one message" in why
    assert "at world size 2: broadcast puts it" in too_large(["broadcast"], [2 * g], [2])


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
def test_the_output_check_opens_no_existing_file_and_leaves_nothing_behind(tmp_path):
    """--json and --plot are tried before the run: a new file is made and removed; what is
    there is not opened (a named pipe's reader got an end of file, and the run's own write
    then blocked for ever), and a link is not followed (a dangling one was replaced by a
    file, its target made)."""
    from ctrlcomm.bench._cli import _writable

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert _writable(str(fifo))  # at once: not opened (with no reader, an open would block)
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "sub" / "target.json")
    assert not _writable(str(link))
    assert link.is_symlink() and not (tmp_path / "sub").exists()
    new = tmp_path / "new.json"
    assert _writable(str(new)) and not new.exists()
    assert not _writable(str(tmp_path)) and not _writable(str(tmp_path / "no" / "r.json"))
    if os.path.isdir("/proc/self"):
        assert not _writable("/proc/r.json")


def test_send_recv_is_left_out_at_world_size_1_saying_so(tmp_path):
    """A ping-pong needs two ranks: at world size 1 there is nothing to time (it reported a
    figure of an empty call)."""
    out = tmp_path / "r.json"
    p = run("-n", "1,2", "--ops", "barrier,send_recv", "--sizes", "8", "--iters", "3",
            "--warmup", "0", "--against", "store", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "send_recv: needs 2 ranks, left out at world size 1" in p.stderr
    keys = sorted((r["system"], r["op"], r["world_size"])
                  for r in json.loads(out.read_text())["results"])
    assert keys == sorted((s, op, n) for s in ("ctrlcomm", "store") for op, n in
                          (("barrier", 1), ("barrier", 2), ("send_recv", 2)))
    for args in (["-n", "1"], ["--host", "127.0.0.1", "--port", "1", "--rank", "0",
                               "--world-size", "1"]):
        p = run(*args, "--ops", "send_recv")
        assert p.returncode == 2 and "nothing to run: send_recv needs 2 ranks" in p.stderr, \
            p.stderr


def _parents():
    """Every process's parent (from /proc)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    return parent


def _children(pid):
    """The ranks ``pid`` spawned (not multiprocessing's resource tracker)."""
    out = []
    for c, pp in _parents().items():
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                if pp == pid and b"spawn_main" in f.read():
                    out.append(c)
        except OSError:
            pass
    return out


def _descendants(pid):
    """Every process below ``pid`` now."""
    parent = _parents()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _still_alive_after(pids, seconds):
    """Those of ``pids`` still alive once all have ended or ``seconds`` have passed."""
    import time

    t = time.monotonic()
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() - t < seconds:
        time.sleep(0.1)
    return left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGKILL"])
def test_bench_ended_by_a_signal_leaves_no_rank_running(sig):
    """SIGTERM: the bench stops its ranks (by pid) and exits with 143 (128 + SIGTERM, as a
    shell reports it; it said 130, Ctrl-C's, and "interrupted"); SIGKILL, where no
    cleanup runs: each rank ends with it (its parent-death signal)."""
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-m", "ctrlcomm", "bench", "-n", "3", "--ops",
                          "barrier", "--iters", "10000000", "--warmup", "0", "--against", "none"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks = []
    try:
        t = time.monotonic()
        while time.monotonic() - t < 60:  # the ranks start
            ranks = _children(p.pid)
            if len(ranks) >= 3:
                break
            time.sleep(0.2)
        assert len(ranks) >= 3, ranks
        time.sleep(1.0)
        p.send_signal(getattr(signal, sig))
        _, err = p.communicate(timeout=30)
        if sig == "SIGTERM":
            assert p.returncode == 143 and "terminated" in err, (p.returncode, err)
        if sig == "SIGHUP":  # (its terminal or ssh session closed: it died of it before)
            assert p.returncode == 129 and "hung up" in err, (p.returncode, err)
        if sig != "SIGKILL":
            # (the progress bar said "1/1 done (last: ctrlcomm N=3 failed)" as it ended)
            assert "done" not in err and "failed" not in err, err
        assert not _still_alive_after(ranks, 10)
    finally:
        for pid in [p.pid, *ranks]:  # (only what this test started)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_while_the_ranks_start_prints_one_line_and_no_traceback():
    """A terminal's Ctrl-C reaches every process of its group, ranks still in Python's
    start-up too: none prints a traceback; the bench stops them and says so."""
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-m", "ctrlcomm", "bench", "-n", "3", "--ops",
                          "barrier", "--iters", "10000000", "--warmup", "0", "--against", "none"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)  # a process group of its own, as in a shell
    ranks = []
    try:
        t = time.monotonic()
        while not ranks and time.monotonic() - t < 60:
            ranks = _children(p.pid)
        assert ranks
        os.killpg(p.pid, signal.SIGINT)  # the first rank has just been started
        _, err = p.communicate(timeout=30)
        assert p.returncode == 130 and "interrupted" in err, (p.returncode, err)
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    finally:
        for pid in [p.pid, *_descendants(p.pid), *ranks]:  # (only what this test started)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        p.communicate()  # reaped (else a later test reports it as a leaked process)


@pytest.mark.slow
def test_bench_multihost_ranks_with_different_settings_say_so(tmp_path):
    from ctrlcomm.testing import free_port

    port = str(free_port())
    procs, outs = multihost({r: ["--host", "127.0.0.1", "--port", port, "--world-size", "2",
                                 "--rank", str(r), "--ops", "barrier", "--iters", str(5 + r)]
                             for r in (1, 0)}, timeout=90)
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 2, err
        assert "different settings" in err and "iters=5" in err and "iters=6" in err, err


def test_bench_multihost_reports_a_taken_port_in_a_line():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        p = run("--host", "127.0.0.1", "--port", str(s.getsockname()[1]), "--rank", "0",
                "--world-size", "1", "--iters", "2", timeout=60)
    assert p.returncode == 1 and "address already in use" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_interrupted_mpi_run_leaves_nothing_running():
    """Ctrl-C or SIGTERM (a KeyboardInterrupt in the bench) while mpiexec runs: mpiexec and
    every process it started are killed, as at its timeout."""
    import signal
    import threading
    import time

    from ctrlcomm.bench import _baselines

    if _baselines.missing("mpi"):
        pytest.skip(_baselines.missing("mpi"))
    seen, stop = set(), threading.Event()
    before = set(_descendants(os.getpid()))  # (a forkserver another test started, say)

    def watch():
        while not stop.is_set():
            seen.update(set(_descendants(os.getpid())) - before)
            time.sleep(0.05)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 4.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            _baselines.run_mpi(2, {"ops": ["barrier"], "sizes": [8], "iters": 10**9,
                                   "warmup": 0, "timeout": 120})
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        stop.set()
        th.join()
    assert len(seen) >= 3, seen  # mpiexec, its proxy, the ranks
    assert not _still_alive_after(seen, 10)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_folders_of_mpi_runs_killed_outright_are_removed_by_a_later_one(tmp_path):
    import time

    from ctrlcomm.bench._baselines import MPI_TMP, STALE_TMP_S, sweep_stale_tmp

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # (a pid that runs no more)
    now = time.time()
    made = {}
    for name, pid, age in [("stale", ended.pid, STALE_TMP_S + 10),
                           ("fresh", ended.pid, 10),  # (perhaps another namespace's run)
                           ("running", os.getppid(), STALE_TMP_S + 10),
                           ("mine", os.getpid(), STALE_TMP_S + 10)]:
        d = tmp_path / f"{MPI_TMP}{pid}-{name}"
        d.mkdir()
        (d / "rank0.json").write_text("[]")
        os.utime(d, (now - age, now - age))
        made[name] = d
    other = tmp_path / "ctrlcomm-bench-mpi-x-y"
    other.mkdir()
    plain = tmp_path / f"{MPI_TMP}{ended.pid}-file"
    plain.write_text("")
    os.utime(plain, (now - STALE_TMP_S - 10, now - STALE_TMP_S - 10))
    assert sweep_stale_tmp(str(tmp_path), now) == [str(made["stale"])]
    assert not made["stale"].exists()
    assert all(made[k].is_dir() for k in ("fresh", "running", "mine"))
    assert other.is_dir() and plain.is_file()
    assert sweep_stale_tmp(str(tmp_path / "none"), now) == []


def test_an_mpi_run_ends_with_a_bench_killed_outright():
    """SIGKILL to the bench while mpiexec runs (no cleanup of its own can run): mpiexec gets
    SIGTERM as the bench ends (its parent-death signal) and ends the ranks it started. (They
    ran on to the end, reparented to init.)"""
    import signal
    import time

    from ctrlcomm.bench import _baselines

    if _baselines.missing("mpi"):
        pytest.skip(_baselines.missing("mpi"))
    # (ctrlcomm's run comes first and must end: 2,000 broadcasts of 1 MiB, which take
    # MPICH seconds here too, so that its ranks still run when the bench is killed)
    p = subprocess.Popen([sys.executable, "-m", "ctrlcomm", "bench", "-n", "2", "--ops",
                          "broadcast", "--sizes", "1M", "--iters", "2000", "--warmup", "0",
                          "--against", "mpi"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    seen = set()
    try:
        t = time.monotonic()
        while time.monotonic() - t < 120:  # (ctrlcomm's run first, then mpiexec's ranks)
            seen.update(_descendants(p.pid))
            names = []
            for pid in seen:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        names.append(f.read())
                except OSError:
                    pass
            if sum(b"bench._mpi" in n and b"mpiexec" not in n for n in names) >= 2:
                break
            time.sleep(0.1)
        else:
            pytest.fail("mpiexec's ranks did not start")
        mpi = _descendants(p.pid)  # (ctrlcomm's own run has ended by now)
        assert len(mpi) >= 4, mpi  # mpiexec, its proxy, the two ranks
        import tempfile

        folder = [e.path for e in os.scandir(tempfile.gettempdir())
                  if e.name.startswith(f"{_baselines.MPI_TMP}{p.pid}-")]
        assert len(folder) == 1, folder  # the run's files, named for its bench
        p.kill()
        p.wait()
        assert not _still_alive_after(mpi, 5)
        # left behind (nothing of the bench could run), and removed by a later run once
        # old enough (not before: it may be the folder of a run of another pid namespace)
        assert os.path.isdir(folder[0])
        assert folder[0] not in _baselines.sweep_stale_tmp()
        later = time.time() + _baselines.STALE_TMP_S + 1
        assert folder[0] in _baselines.sweep_stale_tmp(now=later)
        assert not os.path.exists(folder[0])
    finally:
        for pid in [p.pid, *seen]:  # (only what this test started)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_the_files_are_written_whatever_becomes_of_standard_output(tmp_path):
    """A closed pipe (`| head -1`) or a full disk on standard output: the JSON and the plot
    are written all the same, and a line says the table could not be printed, not a
    traceback. (They were written after the table: a BrokenPipeError lost both.)"""
    pytest.importorskip("matplotlib")
    args = [sys.executable, "-m", "ctrlcomm", "bench", "-n", "2", "--ops", "barrier",
            "--iters", "3", "--warmup", "1", "--against", "none"]
    for how in ("closed pipe", "full disk"):
        out, plot = tmp_path / f"{how}.json", tmp_path / f"{how}.png"
        cmd = [*args, "--json", str(out), "--plot", str(plot)]
        if how == "closed pipe":
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            p.stdout.close()  # (as `head` does once it has its line)
            err = p.stderr.read().decode()
            p.stderr.close()
            p.wait(timeout=120)
        else:
            if not os.path.exists("/dev/full"):
                continue
            with open("/dev/full", "w") as full:
                q = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, timeout=120)
            p, err = q, q.stderr.decode()
        assert out.exists() and plot.exists(), (how, err)
        assert json.loads(out.read_text())["results"], how
        assert "Traceback" not in err and "could not print the table" in err, (how, err)
        assert p.returncode == 0, (how, p.returncode, err)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_plot_that_cannot_be_written_is_said_in_a_line_and_the_table_still_printed():
    # (a full disk as the plot was written: three chained tracebacks, and no table)
    pytest.importorskip("matplotlib")
    saved = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "reference.json")
    q = run("--from-json", saved, "--plot", "/dev/full", timeout=120)
    assert q.returncode == 1 and "Traceback" not in q.stderr, q.stderr
    assert "--plot /dev/full: " in q.stderr and "No space left" in q.stderr, q.stderr
    assert "barrier" in q.stdout and "ctrlcomm" in q.stdout, q.stdout


def test_an_empty_file_name_is_refused_before_anything_runs():
    """(`--json "$OUT"` with OUT unset: the run went ahead and wrote nothing, silently)"""
    for opt in ("--json", "--plot"):
        p = run("-n", "2", "--ops", "barrier", "--iters", "3", opt, "", timeout=60)
        assert p.returncode == 2 and f"{opt}: the file name is empty" in p.stderr, p.stderr


def test_bench_multihost_rank_other_than_0_neither_checks_nor_writes_json_or_plot(tmp_path):
    from ctrlcomm.testing import free_port

    port = str(free_port())
    common = ["--host", "127.0.0.1", "--port", port, "--world-size", "2", "--ops", "barrier",
              "--iters", "3", "--json", "/nonexistent/r.json"]  # (a folder on rank 0's host)
    procs, outs = multihost({1: [*common, "--rank", "1"],
                             0: [*common[:-2], "--json", str(tmp_path / "r.json"),
                                 "--rank", "0"]}, timeout=90)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "ignoring them" in outs[0][1] and (tmp_path / "r.json").exists()


class _Stream:
    def __init__(self, tty):
        self.tty, self.text = tty, ""

    def isatty(self):
        return self.tty

    def write(self, s):
        self.text += s

    def flush(self):
        pass


def test_the_progress_bar_redraws_on_a_terminal_and_writes_a_line_per_tenth_elsewhere():
    from ctrlcomm.bench._run import _Progress

    log = _Stream(tty=False)  # a pipe, a log file, CI
    bar = _Progress(37, log)
    for i in range(37):
        bar.step(f"ctrlcomm N=2 op{i} ")
    bar.end()
    assert "\r" not in log.text
    lines = log.text.splitlines()
    assert len(lines) == 10  # each tenth of the way, the last at 37/37
    assert lines[-1] == "bench: 37/37 done (last: ctrlcomm N=2 op36)"
    assert lines[0] == "bench: 4/37 done (last: ctrlcomm N=2 op3)"  # 4/37 >= 1/10

    term = _Stream(tty=True)
    bar = _Progress(3, term)
    for i in range(3):
        bar.step(f"store N=4 op{i}")
    bar.end()
    assert term.text.count("\r") == 3 and term.text.endswith("\n")
    assert "3/3 done: store N=4 op2" in term.text

    bare = _Progress(2, object.__new__(type("S", (), {"write": lambda s, t: None,
                                                      "flush": lambda s: None})))
    bare.step("x")  # a stream without isatty is not a terminal
    assert bare.tty is False


def _hide_numpy(tmp_path):
    """A PYTHONPATH on which `import numpy` fails, as on a machine without it (ctrlcomm does
    not depend on numpy)."""
    (tmp_path / "numpy.py").write_text("raise ImportError(\"No module named 'numpy' (hidden)\")\n")
    return str(tmp_path)


def test_without_numpy_large_all_reduce_is_refused_before_running_and_mpi_is_skipped(tmp_path):
    env = {"PYTHONPATH": _hide_numpy(tmp_path)}
    # (all_reduce of more than 64 bytes sends a numpy array: it failed every op of the world
    # size, after running some, with a rank's ModuleNotFoundError)
    p = run("-n", "2", "--ops", "barrier,all_reduce", "--sizes", "8,1K", "--iters", "5",
            "--warmup", "1", env=env, timeout=120)
    assert p.returncode == 2 and "numpy is not installed" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "done" not in p.stderr, p.stderr
    # (mpi4py's baseline sends numpy arrays: it failed with every rank's traceback)
    p = run("-n", "2", "--ops", "barrier", "--iters", "5", "--warmup", "1", "--against", "mpi",
            env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "skipping mpi: numpy is not installed" in p.stderr + p.stdout, p.stderr
    assert "Traceback" not in p.stderr, p.stderr


def test_a_failed_mpi_run_says_what_its_ranks_said(tmp_path, monkeypatch):
    import subprocess as sp

    from ctrlcomm.bench import _baselines

    if _baselines.mpiexec() is None:
        pytest.skip("no mpiexec")
    monkeypatch.setenv("PYTHONPATH", _hide_numpy(tmp_path))  # (the ranks fail importing it)
    cfg = {"ops": ["barrier"], "sizes": [8], "iters": 2, "warmup": 0, "timeout": 120}
    with pytest.raises(sp.SubprocessError, match=r"mpiexec -n 2 exited .*numpy.*\(hidden\)"):
        _baselines.run_mpi(2, cfg)


def test_p99_is_the_nearest_rank_percentile():
    from ctrlcomm.bench._run import _p99

    # (it was the sample at int(0.99 n): of 100, the largest; of 1000, the 991st)
    assert _p99(list(range(1, 101))) == 99 and _p99(list(range(1, 1001))) == 990
    assert _p99([7.0]) == 7.0 and _p99([2, 5, 9]) == 9 and _p99(list(range(1, 201))) == 198


def test_bench_formation_compares_with_gloo_and_writes_json(tmp_path):
    pytest.importorskip("torch.distributed")
    out = tmp_path / "f.json"
    p = run("--formation", "-n", "2,3", "--against", "gloo", "--json", str(out))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert [line.split()[0] for line in lines[-2:]] == ["2", "3"], p.stdout
    head = next(line for line in lines if line.strip().startswith("ranks"))
    assert head.split() == ["ranks", "ctrlcomm", "gloo"], head
    rows = json.loads(out.read_text())["formation"]
    assert {(r["n"], r["system"]) for r in rows} == {(n, s) for n in (2, 3)
                                                     for s in ("ctrlcomm", "gloo")}
    assert all(len(r["s"]) == 1 and 0 < r["s"][0] < 60 for r in rows)


def test_bench_formation_refuses_what_it_does_not_take():
    p = run("--formation", "--ops", "barrier")
    assert p.returncode == 2 and "--formation takes" in p.stderr
    p = run("--formation", "--against", "mpi")
    assert p.returncode == 2 and "use gloo, vllm" in p.stderr


def test_bench_compares_by_default_with_what_is_installed(tmp_path):
    # gloo (torch) and MPI (mpi4py, MPICH) are installed for the tests: a run that names
    # nothing compares with both, and the legend explains the ratio column it shows
    pytest.importorskip("torch")
    pytest.importorskip("mpi4py")
    out = tmp_path / "d.json"
    p = run("-n", "2", "--ops", "barrier", "--iters", "5", "--warmup", "1", "--json", str(out),
            default_against=True)
    assert p.returncode == 0, p.stderr
    systems = {r["system"] for r in json.loads(out.read_text())["results"]}
    assert {"ctrlcomm", "gloo", "mpi"} <= systems, systems
    text = " ".join(p.stdout.split())
    assert "gloo med" in p.stdout and "mpi med" in p.stdout
    assert "x: that system's median over ctrlcomm's" in text
    assert "n/a" not in text  # (every system ran a barrier: no cell is n/a, nor explained)
    # with neither installed, it compares with nothing: the legend names no ratio column
    code = ("import sys; sys.modules['torch'] = None; sys.modules['mpi4py'] = None; "
            "from ctrlcomm._cli import main; sys.exit(main(sys.argv[1:]))")
    p = subprocess.run([sys.executable, "-c", code, "bench", "-n", "2", "--ops", "barrier",
                        "--iters", "5", "--warmup", "1"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    head = p.stdout.splitlines()[0]
    assert "ctrlcomm med" in head and "gloo" not in head and "mpi" not in head
    assert "x:" not in p.stdout and "n/a" not in p.stdout and "med, p99:" in p.stdout


def test_the_plot_title_names_the_machine_and_date():
    from ctrlcomm.bench import _run as b

    cfg = {"cpus": 2, "python": "3.11.7", "when": "2026-12-07T10:00:00",
           "host": {"cpu": "AMD EPYC", "kernel": "Linux 6.18"}}
    title = b.plot_title(cfg)
    assert "median latency" in title and "p99" in title
    assert all(s in title for s in ("AMD EPYC", "2 CPUs", "Linux 6.18", "2026-12-07 10:00:00"))
    # one colour per system, whatever the order of the systems in the run
    assert len({b.COLORS[s] for s in ("ctrlcomm", "ctrlcomm-aio", "gloo", "mpi", "store",
                                      "star")}) == 6
