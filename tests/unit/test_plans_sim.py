"""Every plan, every world size 1..33, random delivery orders, against a sequential reference."""

import math
import operator
from functools import reduce as freduce

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ctrlcomm import _algo, _ops, _plans
from ctrlcomm.testing import DeadlockError, simulate

sizes = st.integers(min_value=1, max_value=33)
seeds = st.integers(min_value=0, max_value=2**32 - 1)


def values(n):
    return [(r * 7919 + 13) % 1000 - 500 for r in range(n)]


@given(n=sizes, seed=seeds)
def test_barrier(n, seed):
    res = simulate(_plans.barrier, n, seed=seed)
    assert res.results == [None] * n


@given(n=sizes, seed=seeds, data=st.data())
def test_broadcast(n, seed, data):
    root = data.draw(st.integers(0, n - 1))
    res = simulate(lambda c: _plans.broadcast(c, {"from": c.rank, "v": [1, 2]}, root), n, seed=seed)
    assert res.results == [{"from": root, "v": [1, 2]}] * n


@given(n=sizes, seed=seeds, data=st.data())
def test_gather(n, seed, data):
    root = data.draw(st.integers(0, n - 1))
    res = simulate(lambda c: _plans.gather(c, ("r", c.rank), root), n, seed=seed)
    for r in range(n):
        assert res.results[r] == ([("r", i) for i in range(n)] if r == root else None)


@given(n=sizes, seed=seeds, data=st.data())
def test_scatter(n, seed, data):
    root = data.draw(st.integers(0, n - 1))
    objs = [f"item{i}" for i in range(n)]
    res = simulate(lambda c: _plans.scatter(c, objs if c.rank == root else None, root), n,
                   seed=seed)
    assert res.results == objs


@pytest.mark.parametrize("op", ["sum", "prod", "max", "min", "band", "bor", "land", "lor"])
@given(n=sizes, seed=seeds, data=st.data())
def test_reduce_and_all_reduce(op, n, seed, data):
    root = data.draw(st.integers(0, n - 1))
    vals = values(n)
    combine = _ops.safe(_ops.resolve(op, "t", 0))
    expected = freduce(combine, [(v, 1) for v in vals])
    for ordered in (True, False):  # (False: the named ops' tree, rooted at the root)
        res = simulate(lambda c, o=ordered: _plans.reduce(c, (vals[c.rank], 1), combine, root,
                                                          o), n, seed=seed)
        assert res.results[root] == expected
        assert all(x is None for r, x in enumerate(res.results) if r != root)
    for plan in (_plans.all_reduce_doubling, _plans.all_reduce_flat):
        res = simulate(lambda c, p=plan: p(c, (vals[c.rank], 1), combine), n, seed=seed)
        assert res.results == [expected] * n


@given(n=sizes, seed=seeds, data=st.data())
def test_reductions_combine_in_rank_order_whatever_the_root(n, seed, data):
    # an op that is associative but does not commute (MPI allows it, and folds in rank
    # order): concatenation. The tree reduce folded from its root on ([4..8, 0..3] for dst
    # 4 of 9), as its virtual ranks run
    root = data.draw(st.integers(0, n - 1))
    combine = _ops.safe(operator.add)
    for name, plan in _algo.VARIANTS["reduce"].items():
        res = simulate(lambda c, p=plan: p(c, [c.rank], combine, root), n, seed=seed)
        assert res.results == [list(range(n)) if r == root else None for r in range(n)], \
            (name, n, root)
    for name, plan in _algo.VARIANTS["all_reduce"].items():
        res = simulate(lambda c, p=plan: p(c, [c.rank], combine), n, seed=seed)
        assert res.results == [list(range(n))] * n, (name, n)


@given(n=sizes, seed=seeds)
def test_all_reduce_float_results_identical_on_all_ranks(n, seed):
    vals = [0.1 * (r + 1) ** 1.7 for r in range(n)]
    res = simulate(lambda c: _plans.all_reduce_doubling(c, vals[c.rank], operator.add), n,
                   seed=seed)
    assert len({repr(x) for x in res.results}) == 1
    assert math.isclose(res.results[0], sum(vals))


@given(n=sizes, seed=seeds)
def test_all_gather(n, seed):
    for plan in (_plans.all_gather_bruck, _plans.all_gather_flat):
        res = simulate(lambda c, p=plan: p(c, {"rank": c.rank}), n, seed=seed)
        assert res.results == [[{"rank": i} for i in range(n)]] * n


@given(n=sizes, seed=seeds)
def test_all_to_all(n, seed):
    res = simulate(lambda c: _plans.all_to_all(c, [(c.rank, j) for j in range(n)]), n, seed=seed)
    for r in range(n):
        assert res.results[r] == [(i, r) for i in range(n)]


def test_failed_reduction_keeps_every_rank_in_step():
    combine = _ops.safe(_ops.resolve("sum", "t", 0))
    vals = [(1, 2)] * 5 + [(1, 2, 3)]
    res = simulate(lambda c: _plans.all_reduce_doubling(c, vals[c.rank], combine), 6)
    assert all(isinstance(x, _ops.Failed) for x in res.results)
    assert "different lengths" in res.results[0].message


def test_simulator_detects_deadlock():
    def bad(ctx):
        got = yield _plans.Step(0, recvs=((ctx.rank + 1) % ctx.size,))
        return got

    with pytest.raises(DeadlockError):
        simulate(bad, 3)


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("barrier", lambda c: _plans.barrier(c)),
        ("broadcast", lambda c: _plans.broadcast(c, 1, 0)),
        ("all_reduce", lambda c: _plans.all_reduce_doubling(c, 1, operator.add)),
        ("all_gather", lambda c: _plans.all_gather_bruck(c, 1)),
        ("reduce", lambda c: _plans.reduce(c, 1, operator.add, 0)),
        ("gather", lambda c: _plans.gather(c, 1, 0)),
        ("scatter", lambda c: _plans.scatter(c, list(range(c.size)) if c.rank == 0 else None, 0)),
    ],
)
def test_messages_and_hops_grow_logarithmically(name, make):
    for n in [1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 64, 100, 128]:
        res = simulate(make, n)
        bound = math.ceil(math.log2(n)) + 2 if n > 1 else 0
        assert max(res.sends) <= bound, (name, n, res.sends)
        assert max(res.steps) <= bound, (name, n, res.steps)


@pytest.mark.parametrize("op", sorted(_algo.VARIANTS))
@given(n=sizes, seed=seeds, data=st.data())
def test_every_variant_of_every_collective(op, n, seed, data):
    root = data.draw(st.integers(0, n - 1))
    combine = _ops.safe(_ops.resolve("sum", "t", 0))
    vals = values(n)
    for name, plan in _algo.VARIANTS[op].items():
        if op == "barrier":
            make, want = (lambda c, p=plan: p(c)), [None] * n
        elif op == "broadcast":
            make, want = (lambda c, p=plan: p(c, ("b", c.rank), root)), [("b", root)] * n
        elif op == "gather":
            make = lambda c, p=plan: p(c, c.rank, root)  # noqa: E731
            want = [list(range(n)) if r == root else None for r in range(n)]
        elif op == "scatter":
            make = lambda c, p=plan: p(c, list(range(100, 100 + n)) if c.rank == root else None, root)  # noqa: E731
            want = list(range(100, 100 + n))
        elif op == "reduce":
            make = lambda c, p=plan: p(c, vals[c.rank], combine, root)  # noqa: E731
            want = [sum(vals) if r == root else None for r in range(n)]
        elif op == "all_reduce":
            make, want = (lambda c, p=plan: p(c, vals[c.rank], combine)), [sum(vals)] * n
        else:
            make, want = (lambda c, p=plan: p(c, c.rank)), [list(range(n))] * n
        assert simulate(make, n, seed=seed).results == want, (op, name, n)


def test_chosen_algorithms_grow_logarithmically_beyond_small_worlds():
    for op in ("barrier", "broadcast", "all_reduce"):
        for n in (2, 8, 9, 33, 100):
            plan = _algo.choose(op, n)
            combine = _ops.safe(_ops.resolve("sum", "t", 0))
            if op == "barrier":
                res = simulate(plan, n)
            elif op == "broadcast":
                res = simulate(lambda c, p=plan: p(c, 1, 0), n)
            else:
                res = simulate(lambda c, p=plan, f=combine: p(c, 1, f), n)
            bound = max(n - 1, 2) if n <= _algo.SMALL_WORLD else math.ceil(math.log2(n)) + 2
            assert max(res.sends) <= bound and max(res.steps) <= bound, (op, n, res.sends)


@pytest.mark.parametrize("op", ["max", "min"])
@given(n=st.integers(1, 12), seed=seeds, data=st.data())
def test_a_nan_on_any_rank_is_every_ranks_max_and_min_whatever_the_algorithm(op, n, seed,
                                                                              data):
    # as numpy's and torch's maximum and minimum: "a if a >= b else b" alone gave the other
    # operand where either was NaN, so the result hung on the order of combining ([0.0, nan,
    # 2.0] -> min 2.0 by the star, reduce's tree 0.0), and a plain list held it elsewhere
    # than an array of the same values (always nan)
    nan_at = data.draw(st.integers(0, n - 1))
    root = data.draw(st.integers(0, n - 1))
    vals = [float("nan") if r == nan_at else float(data.draw(st.integers(-3, 3)))
            for r in range(n)]
    combine = _ops.combiner(op, "all_reduce", 0)
    for operand in (lambda r: vals[r], lambda r: [vals[r], 1.0], lambda r: (1, vals[r])):
        for name, plan in _algo.VARIANTS["all_reduce"].items():
            res = simulate(lambda c, p=plan, f=operand: p(c, f(c.rank), combine), n, seed=seed)
            assert all("nan" in repr(x) for x in res.results), (name, vals, res.results)
        for name, plan in _algo.VARIANTS["reduce"].items():
            for ordered in (True, False):
                res = simulate(lambda c, p=plan, o=ordered, f=operand: p(c, f(c.rank), combine,
                                                                         root, o),
                               n, seed=seed)
                assert "nan" in repr(res.results[root]), (name, ordered, vals, res.results)
    assert combine(1.0, 2.0) == (2.0 if op == "max" else 1.0)  # (numbers as before)
    assert combine([1.0, 5], [2.0, 3]) == ([2.0, 5] if op == "max" else [1.0, 3])


def _reduction_plans():
    for op in ("all_reduce", "reduce"):
        for name, plan in _algo.VARIANTS[op].items():
            if op == "reduce":
                for ordered in (True, False):
                    yield f"reduce-{name}-{'ordered' if ordered else 'any'}", plan, ordered
            else:
                yield f"all_reduce-{name}", plan, None


@pytest.mark.parametrize(("name", "plan", "ordered"), list(_reduction_plans()),
                         ids=[p[0] for p in _reduction_plans()])
@given(n=st.integers(2, 33), seed=seeds, data=st.data())
def test_a_failed_combination_names_the_ranks_it_combined(name, plan, ordered, n, seed, data):
    # each rank's operand is the set of its rank; combining unions them, and fails where
    # rank `bad`'s operand first meets another's, saying which sets it was given: the
    # failure's sides are those sets, the same on every rank that gets the failure
    bad = data.draw(st.integers(0, n - 1))
    root = data.draw(st.integers(0, n - 1))

    def union(a, b):
        if bad in a | b and len(a | b) > 1:
            raise ValueError(f"{sorted(a)}|{sorted(b)}")
        return a | b

    combine = _ops.safe(union)
    if ordered is None:
        res = simulate(lambda c: plan(c, frozenset({c.rank}), combine), n, seed=seed)
        got = res.results
    else:
        res = simulate(lambda c: plan(c, frozenset({c.rank}), combine, root, ordered), n, seed=seed)
        got = [res.results[root]]
    assert all(type(x) is _ops.Failed for x in got), got
    assert len({(x.message, x.sides) for x in got}) == 1
    left, right = got[0].sides
    assert got[0].message == f"ValueError: {sorted(left)}|{sorted(right)}"
    assert bad in left + right and not set(left) & set(right)
    if name in ("all_reduce-flat", "all_reduce-star", "reduce-flat-ordered", "reduce-flat-any"):
        # a fold in rank order: the ranks before the first that does not combine, and it
        assert (left, right) == ((tuple(range(bad)), (bad,)) if bad else ((0,), (1,)))
    else:
        assert all(type(x) is _ops.Failed for x in res.results if x is not None)
