"""Float comparisons for the tests, as float32 computes them: the one place their tolerances live.

`assert_close` and `approx` allow a relative error of a few float32 roundings (`FLOAT32_RTOL`) plus an absolute one
for values near 0; `assert_same` is for the places where the computation is the same and equality is the claim
(a bitwise resume, a loop equal to another bit for bit). tests/test_floats.py keeps the suite on these three."""

import pytest
import torch

# float32's machine epsilon is 1.19e-7 (one ulp at 1.0); a reduction reordered (another BLAS, thread count, kernel or
# micro-batching) over a few thousand terms moves its result by tens of ulps. 4e-6 is ~32 ulps: above that noise,
# far below any real difference.
FLOAT32_RTOL = 4e-6
# The absolute bound for values near 0, where a relative one means nothing (a sum that cancels to 1e-8).
FLOAT32_ATOL = 1e-6


def _as_tensors(actual, expected):
    """A number or (nested) list against a tensor becomes a tensor of the other side's dtype and device."""
    if isinstance(actual, torch.Tensor) and not isinstance(expected, torch.Tensor) and isinstance(
            expected, (int, float, bool, list, tuple)):
        expected = torch.as_tensor(expected, dtype=actual.dtype, device=actual.device)
    elif isinstance(expected, torch.Tensor) and not isinstance(actual, torch.Tensor) and isinstance(
            actual, (int, float, bool, list, tuple)):
        actual = torch.as_tensor(actual, dtype=expected.dtype, device=expected.device)
    return actual, expected


def assert_close(actual, expected, *, atol: float = FLOAT32_ATOL, rtol: float = FLOAT32_RTOL, msg=None) -> None:
    """`actual` equals `expected` up to float32 rounding: |actual - expected| <= atol + rtol * |expected| entrywise
    (`torch.testing.assert_close`: tensors, numbers, and lists / tuples / dicts of them; dtype, shape and device
    checked; NaN fails). A number or list against a tensor is made a tensor of that dtype. Integer and boolean
    tensors are compared exactly. `msg` prefixes torch's report (which names the worst entry). `rtol=0` is refused:
    a computed float moves with its relative rounding; for a claim of bitwise equality use `assert_same`."""
    if rtol == 0:
        raise ValueError("assert_close(..., rtol=0): a computed float32 value is equal only up to its relative "
                         "rounding; where the computation is the same and equality is the claim, use floats.assert_same")
    actual, expected = _as_tensors(actual, expected)
    if (isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)
            and not (actual.is_floating_point() or actual.is_complex())
            and not (expected.is_floating_point() or expected.is_complex())):
        atol = rtol = 0  # integers and booleans: exact (a relative bound would let 1 in 250,000 through)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol,
                               msg=None if msg is None else (lambda report: f"{msg}: {report}"))


def approx(expected, *, abs: float = FLOAT32_ATOL, rel: float = FLOAT32_RTOL):  # noqa: A002 (pytest's names)
    """`pytest.approx` with both tolerances, for a number or a list / tuple / dict / array of them: within
    max(rel * |expected|, abs) (pytest ignores the relative tolerance when `abs` alone is given). rel=0 is refused, as
    in `assert_close`."""
    if rel == 0:
        raise ValueError("approx(..., rel=0): a computed float32 value is only equal up to its relative rounding; "
                         "compare exact values with ==, or use floats.assert_same")
    return pytest.approx(expected, rel=rel, abs=abs)


def _difference(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Which entries of two same-shaped tensors differ, and how far and where the worst one is."""
    differ = actual != expected
    wide = torch.float64 if not actual.is_complex() else torch.complex128
    gap = (actual.detach().cpu().to(wide) - expected.detach().cpu().to(wide)).abs()
    gap = torch.where(differ.cpu(), gap.nan_to_num(nan=float("inf")), torch.zeros((), dtype=gap.dtype))
    flat = int(gap.argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), actual.shape)) if actual.dim() else ()
    a, e = actual.detach().cpu().reshape(-1)[flat].item(), expected.detach().cpu().reshape(-1)[flat].item()
    off = abs(a - e) if a == a and e == e else float("nan")
    relative = f" ({off / abs(e):.3g} relative)" if e and off == off else ""
    return (f"{int(differ.sum())} of {actual.numel()} entries differ; the worst, at index {where}, is {off:.6g} off"
            f"{relative}: actual {a!r}, expected {e!r}")


def assert_same(actual, expected, msg=None) -> None:
    """`actual` equals `expected` bit for bit, for where the computation is the same and equality is the claim (a
    bitwise resume, a weight copy, a loop equal to another). Tensors: the same dtype, shape and device and every
    entry == (torch.equal: NaN fails, -0.0 == 0.0); dicts, lists and tuples entry by entry; anything else ==. The
    failure names the key / index path, how many entries differ and how far off the worst is, and where."""
    _same(actual, expected, "" if msg is None else str(msg))


def _same(actual, expected, where: str) -> None:
    prefix = f"{where}: " if where else ""
    actual, expected = _as_tensors(actual, expected)
    if isinstance(actual, torch.Tensor) or isinstance(expected, torch.Tensor):
        if not (isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)):
            raise AssertionError(f"{prefix}a {type(actual).__name__} against a {type(expected).__name__}")
        for what in ("dtype", "shape", "device"):
            if getattr(actual, what) != getattr(expected, what):
                raise AssertionError(f"{prefix}{what}s differ: {getattr(actual, what)} vs {getattr(expected, what)}")
        if not torch.equal(actual, expected):
            raise AssertionError(f"{prefix}not bit for bit: {_difference(actual, expected)}")
    elif isinstance(actual, dict) and isinstance(expected, dict):
        if actual.keys() != expected.keys():
            raise AssertionError(f"{prefix}keys differ: only in actual {sorted(map(str, actual.keys() - expected))}, "
                                 f"only in expected {sorted(map(str, expected.keys() - actual))}")
        for key in actual:
            _same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(actual, (list, tuple)) and isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            raise AssertionError(f"{prefix}lengths differ: {len(actual)} vs {len(expected)}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            _same(a, e, f"{where}[{i}]")
    elif not actual == expected:
        off = ""
        if isinstance(actual, (int, float)) and isinstance(expected, (int, float)):
            off = f" ({abs(actual - expected):.6g} off)"
        raise AssertionError(f"{prefix}not bit for bit: actual {actual!r}, expected {expected!r}{off}")
