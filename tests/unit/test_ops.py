import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ctrlcomm import InvalidArgumentError, _ops, _plans


def combine(op):
    return _ops.resolve(op, "all_reduce", 0)


@pytest.mark.parametrize(
    ("op", "a", "b", "want"),
    [
        ("sum", 1, 2, 3),
        ("sum", (1, 2), (3, 4), (4, 6)),
        ("sum", [1, 2], [3, 4], [4, 6]),
        ("sum", 2**100, 2**100, 2**101),
        ("prod", (2, 3), (4, 5), (8, 15)),
        ("max", (1, 9), (5, 2), (5, 9)),
        ("min", (1, 9), (5, 2), (1, 2)),
        ("max", -(2**40), -(2**41), -(2**40)),
        ("band", 0b1100, 0b1010, 0b1000),
        ("bor", 0b1100, 0b1010, 0b1110),
        ("land", (True, True), (True, False), (True, False)),
        ("lor", (0, 0), (0, 3), (0, 1)),
        ("sum", ((1, 2), 3), ((1, 1), 1), ((2, 3), 4)),
    ],
)
def test_named_ops(op, a, b, want):
    got = combine(op)(a, b)
    assert got == want
    assert type(got) is type(want)


def test_callable_op():
    assert combine(lambda a, b: a + "|" + b)("x", "y") == "x|y"


def test_unknown_op_names_it():
    with pytest.raises(InvalidArgumentError, match="'avg'"):
        _ops.resolve("avg", "all_reduce", 3)


@pytest.mark.parametrize(
    ("op", "value"),
    [("sum", "text"), ("band", 1.5), ("max", 1j), ("sum", (1, "x")), ("sum", None)],
)
def test_bad_operands_rejected_before_sending(op, value):
    with pytest.raises(InvalidArgumentError, match=f"rank 2.*{op!r}"):
        _ops.check_operand(op, value, "all_reduce", 2)


def test_failures_propagate_as_values():
    f = _ops.safe(combine("sum"))
    bad = f((1, 2), (1, 2, 3))
    assert isinstance(bad, _ops.Failed)
    assert f(bad, (1, 2)) is bad and f((1, 2), bad) is bad


def test_numpy_arrays():
    np = pytest.importorskip("numpy")
    got = combine("max")(np.array([1, 5]), np.array([4, 2]))
    assert got.tolist() == [4, 5]


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_arrays_of_other_shapes_do_not_combine(lib):
    # (numpy and torch broadcast them: a (3,) and a (2, 3) summed to a (2, 3), and an array
    # and a number to an array, where MPI and torch.distributed want one shape everywhere)
    m = pytest.importorskip(lib)
    f = _ops.combiner("sum", "all_reduce", 0)
    one = m.ones(3)
    for other, seen in ((m.ones((2, 3)), "shape (2, 3)"), (m.ones(1), "shape (1,)"),
                        (2, "a scalar"), (m.ones(()), "a scalar")):
        for a, b in ((one, other), (other, one)):
            bad = f(a, b)
            assert isinstance(bad, _ops.Failed), (a, b, bad)
            assert "different shapes" in bad.message and seen in bad.message
            assert "shape (3,)" in bad.message
    assert f(one, m.ones(3)).tolist() == [2.0] * 3
    assert float(f(m.ones(()), 2)) == 3.0  # (0-d: a scalar, with numbers)
    assert [x.tolist() for x in f([one, (one,)], [one, (one,)])[:1]] == [[2.0] * 3]
    bad = f([one, 1], [m.ones(4), 1])  # (inside a list too)
    assert isinstance(bad, _ops.Failed) and "shape (4,)" in bad.message


_plain = st.one_of(st.integers(-(2**70), 2**70), st.booleans(),
                   st.floats(allow_nan=True, allow_infinity=True))
_operand = st.one_of(_plain, st.lists(_plain, max_size=4), st.tuples(_plain, _plain),
                     st.lists(st.lists(_plain, max_size=2), max_size=2))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(_ops.NAMED_OPS), _operand, _operand)
@example("max", [float("nan"), 1], [1.0, 2]).via("NaN on either side")
@example("min", (1.0, float("nan")), (float("nan"), 2.0)).via("NaN on either side")
@example("sum", [1, 2], (1, 2)).via("list and tuple")
@example("band", [1, 2.5], [1, 2]).via("a float where ints are needed")
def test_fast_combiner_agrees_with_the_general_one(op, a, b):
    # the fast paths for plain numbers and flat lists/tuples give what the element-wise walk
    # gives: same value, same type, same failure (NaN compared the same way too)
    fast = _ops.combiner(op, "all_reduce", 0)(a, b)
    slow = _ops.safe(combine(op))(a, b)
    if isinstance(slow, _ops.Failed):
        assert isinstance(fast, _ops.Failed) and fast.message == slow.message
    else:
        assert repr(fast) == repr(slow) and type(fast) is type(slow)


_ints = st.one_of(st.integers(-(2**70), 2**70), st.booleans())
# operands alike (the shape a root's fold takes in one pass): scalars of one kind, or lists
# or tuples of one length; and, less often, anything
_operands = st.one_of(
    st.sampled_from([_ints, _plain, st.integers(-3, 3)]).flatmap(
        lambda elem: st.one_of(
            st.lists(elem, min_size=1, max_size=8),
            st.tuples(st.integers(0, 4), st.sampled_from([list, tuple])).flatmap(
                lambda shape: st.lists(
                    st.lists(elem, min_size=shape[0], max_size=shape[0]).map(shape[1]),
                    min_size=1, max_size=8)))),
    st.lists(_operand, min_size=1, max_size=5))


def _pairwise(combine, vals):
    acc = vals[0]
    for v in vals[1:]:
        acc = combine(acc, v)
    return acc


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(_ops.NAMED_OPS), _operands)
@example("max", [(1, float("nan")), (2, 1.0), (0, 3.0)]).via("NaN in a column (floats)")
@example("max", [1, True, 1]).via("equals of two types: the first kept")
@example("min", [(False, 0), (0, False)]).via("the first of equals, per column")
@example("sum", [(10**400,), (1.0,), (2,)]).via("overflow: the same failure")
@example("sum", [(1, 2), [1, 2]]).via("a list and a tuple")
@example("sum", [(1, 2), (1, 2, 3)]).via("different lengths")
@example("band", [(1, 2.5), (1, 2)]).via("a float where ints are needed")
@example("sum", [(1,), _ops.Failed("earlier", "operand"), (2,)]).via("a failure absorbs")
def test_a_fold_of_many_operands_agrees_with_folding_them_pairwise(op, vals):
    # a root's fold in one pass (plans' fold, by the combiner's .fold) gives what combining
    # the operands one by one, left to right, gives: same value, type and failure
    combine = _ops.combiner(op, "all_reduce", 0)
    want = _pairwise(combine, vals)
    many = getattr(combine, "fold", None)  # (land and lor have none: pairwise)
    for got in ([many(vals)] if many else []) + [_plans.fold(combine, vals)]:
        if isinstance(want, _ops.Failed):
            assert isinstance(got, _ops.Failed)
            assert (got.message, got.kind) == (want.message, want.kind)
        else:
            assert repr(got) == repr(want) and type(got) is type(want)
    assert _plans.fold(lambda a, b: a + b, [1, 2, 3]) == 6  # (a callable without .fold)


class _NoRepr:
    def __repr__(self):
        raise RuntimeError("no repr")


@pytest.mark.parametrize("bad", [_NoRepr(), {"k": 10**5000}, "x" * 10_000])
def test_a_bad_operand_is_named_even_when_its_repr_fails_or_is_huge(bad):
    """The message shows the operand without running into its repr's failure (which would
    escape as a bare error before the rank takes part in the call)."""
    with pytest.raises(InvalidArgumentError) as e:
        _ops.check_operand("sum", bad, "all_reduce", 3)
    text = str(e.value)
    assert "all_reduce on rank 3" in text and type(bad).__name__ in text and len(text) < 400
