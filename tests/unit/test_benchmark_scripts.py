"""The pure-layer benchmark scripts still run against the current core (they bypass the
public API, so nothing else would notice when they break)."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_call_overhead_runs_a_whole_call():
    g = _load("call_overhead").answered_group()
    # the answering endpoint returns what the rank sent as the root's reply, through the
    # framing the core chose (one piece for a stream endpoint) and the mailbox
    for i in range(3):
        assert g.all_reduce([i, 2], op="max") == [i, 2]
        assert g.all_gather({"rank": i}) == {"rank": i}
        assert g.barrier() is None
    assert g._core.seq == 9
