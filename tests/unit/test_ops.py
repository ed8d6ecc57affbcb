import pytest

from ctrlcomm import InvalidArgumentError, _ops


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
