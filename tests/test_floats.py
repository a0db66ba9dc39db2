"""tests/floats.py on hand-made values, and the suite held to it: floats are compared as float32 computes them, through
that one helper, never with rtol=0 on computed values."""

import math
import re
from pathlib import Path

import pytest
import torch
from floats import FLOAT32_ATOL, FLOAT32_RTOL, approx, assert_close, assert_same

TESTS = Path(__file__).resolve().parent


def test_the_defaults_are_a_few_float32_roundings():
    ulp = torch.finfo(torch.float32).eps  # 1.19e-7
    assert 10 * ulp < FLOAT32_RTOL < 100 * ulp
    assert 0 < FLOAT32_ATOL <= 1e-5


def test_a_relative_2e_6_at_magnitude_5_passes_and_1e_4_fails():
    five = torch.tensor([5.0, -5.0, 5.4])
    assert_close(five * (1 + 2e-6), five)  # ~17 ulps: a reordered reduction's worth
    assert_close(5.0 * (1 + 2e-6), 5.0)
    assert_close([5.0 * (1 + 2e-6), 1.0], [5.0, 1.0])
    assert_close(five * (1 + 2e-6), five.tolist())  # a list against a tensor: made a tensor of its dtype
    assert 5.0 * (1 + 2e-6) == approx(5.0) and [5.0 * (1 - 2e-6)] == approx([5.0])
    assert {"loss": 5.0 * (1 + 2e-6)} == approx({"loss": 5.0})
    with pytest.raises(AssertionError, match=r"(?i)relative difference: .*\(up to 4e-06 allowed\)"):
        assert_close(five * (1 + 1e-4), five)
    with pytest.raises(AssertionError):
        assert_close(5.0 * (1 + 1e-4), 5.0)
    assert 5.0 * (1 + 1e-4) != approx(5.0)
    # the log-prob that broke `atol=1e-5, rtol=0`: 5.4 and 1.05e-5 off (2e-6 relative)
    assert_close(torch.tensor(-5.4 - 1.05e-5), torch.tensor(-5.4))


def test_values_near_0_use_the_atol():
    assert_close(torch.tensor([1e-7, -9e-7, 0.0]), torch.zeros(3))  # a relative bound means nothing at 0
    assert 9e-7 == approx(0.0) and -9e-7 == approx(0.0)
    with pytest.raises(AssertionError, match=r"(?i)absolute difference: .*\(up to 1e-06 allowed\)"):
        assert_close(torch.tensor([3e-6]), torch.zeros(1))
    assert 3e-6 != approx(0.0)
    assert_close(torch.tensor([3e-6]), torch.zeros(1), atol=1e-5)  # a looser bound, where a test says why
    assert 3e-6 == approx(0.0, abs=1e-5)


def test_rtol_0_is_refused_in_favour_of_assert_same():
    with pytest.raises(ValueError, match="assert_same"):
        assert_close(torch.ones(2), torch.ones(2), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="assert_same"):
        approx(1.0, rel=0)


def test_a_message_prefixes_torchs_report():
    with pytest.raises(AssertionError, match=r"(?s)^layer.0.weight: Tensor-likes are not close!.*index \(1,\)"):
        assert_close(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.1]), msg="layer.0.weight")


def test_integers_and_booleans_are_compared_exactly():
    assert_close(torch.tensor([3, 300_000]), torch.tensor([3, 300_000]))
    with pytest.raises(AssertionError):
        assert_close(torch.tensor([3, 300_000]), torch.tensor([3, 300_001]))  # 3e-6 relative: still unequal
    with pytest.raises(AssertionError):
        assert_close(torch.tensor([True]), torch.tensor([False]))


def test_assert_same_fails_on_one_ulp_and_says_where_and_how_far():
    expected = torch.tensor([[1.0, 2.0], [-5.4, 3.0]])
    actual = expected.clone()
    actual[1, 0] = torch.nextafter(expected[1, 0], torch.tensor(-math.inf))  # one ulp off
    assert_same(expected.clone(), expected)
    assert_close(actual, expected)  # close, as float32 computes it
    with pytest.raises(AssertionError, match=r"^logp: not bit for bit: 1 of 4 entries differ; the worst, at index "
                                             r"\(1, 0\), is 4\.76837e-07 off"):
        assert_same(actual, expected, msg="logp")
    with pytest.raises(AssertionError, match=r"^\['w'\]\[1\]: not bit for bit: .* at index \(1, 0\)"):
        assert_same({"w": [expected, actual]}, {"w": [expected, expected]})
    with pytest.raises(AssertionError, match="dtypes differ"):
        assert_same(expected, expected.double())
    with pytest.raises(AssertionError, match="shapes differ"):
        assert_same(expected, expected.reshape(4))
    with pytest.raises(AssertionError, match="not bit for bit"):
        assert_same(1.0, math.nextafter(1.0, 2.0))
    assert_same({"step": 3, "loss": [0.5, 0.25]}, {"step": 3, "loss": [0.5, 0.25]})


# the ways around the helper: torch's and pytest's comparisons called (or imported) directly, and rtol=0 / rtol=0.0
DIRECT = re.compile(r"torch\.testing\.assert_close\(|pytest\.approx\(|from torch\.testing import assert_close"
                    r"|from pytest import approx|\brtol\s*=\s*0(?:\.0*)?(?![\w.])")


def test_every_float_comparison_in_tests_goes_through_floats_py():
    """"Floats are compared as float32 computes them: an rtol of a few 1e-6 with an atol for values near 0, through
    one helper in tests/; never rtol=0 on computed values. Exact equality only where the computation is the same,
    and then say so." This keeps it so: no file under tests/ but the helper and this one compares directly."""
    hits = []
    for path in sorted(TESTS.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts or path in {TESTS / "floats.py", TESTS / "test_floats.py"}:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if DIRECT.search(line):
                hits.append(f"{path.relative_to(TESTS.parent)}:{number}: {line.strip()}")
    assert not hits, ("compare floats with floats.assert_close / approx (float32's rtol plus an atol), or "
                      "floats.assert_same where equality is the claim:\n" + "\n".join(hits))


def test_the_scan_sees_each_way_around():
    for line in ["torch.testing.assert_close(a, b)", "x == pytest.approx(1.0, abs=1e-6)", "atol=1e-5, rtol=0)",
                 "rtol = 0.0,", "from pytest import approx"]:
        assert DIRECT.search(line), line
    for line in ["assert_close(a, b, rtol=0.01)", "x == approx(1.0)", "rtol=0.5", "my_rtol=0.1"]:
        assert not DIRECT.search(line), line
