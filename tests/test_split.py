import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ase_tcfp32._kernels import round_tf32, split_bf16x3, split_tf32
from ase_tcfp32._kernels.split import scale_rows, split_fp16

normal_floats = st.floats(allow_nan=False, allow_infinity=False, width=32).filter(lambda v: v == 0 or abs(v) > 1e-30)
vectors = arrays(np.float32, st.integers(1, 64), elements=normal_floats)


def bits(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.uint32)


@settings(max_examples=200, deadline=None)
@given(vectors)
def test_tf32_split_is_exact_and_hi_has_tf32_precision(values):
    x = torch.from_numpy(values)
    hi, lo = split_tf32(x)
    assert torch.equal(hi + lo, x)  # exact remainder
    assert np.all(bits(hi) & 0x1FFF == 0)  # hi is a TF32 value
    assert torch.all(lo.abs() <= 2.0**-11 * x.abs())  # within half a TF32 ulp
    assert torch.all(torch.isfinite(hi))


def test_tf32_rounding_is_to_nearest_with_ties_away_from_zero():
    one = 1.0
    ulp = 2.0**-10
    x = torch.tensor([one + ulp / 2, -(one + ulp / 2), one + ulp / 2 - 2**-23, one + 3 * ulp / 2], dtype=torch.float32)
    assert round_tf32(x).tolist() == [one + ulp, -(one + ulp), one, one + 2 * ulp]


def test_rounding_that_overflows_falls_back_to_truncation():
    x = torch.tensor([3.4028235e38, -3.4028235e38], dtype=torch.float32)
    hi, lo = split_tf32(x)
    assert torch.all(torch.isfinite(hi)) and torch.equal(hi + lo, x)
    parts = split_bf16x3(x)
    assert all(torch.all(torch.isfinite(p)) for p in parts)
    assert torch.equal(parts[0] + (parts[1] + parts[2]), x)


@settings(max_examples=200, deadline=None)
@given(arrays(np.float32, st.integers(1, 64), elements=normal_floats.filter(lambda v: v == 0 or abs(v) > 1e-25)))
def test_bf16_split_is_exact_with_bf16_words(values):
    x = torch.from_numpy(values)
    hi, mid, lo = split_bf16x3(x)
    for word in (hi, mid, lo):
        assert np.all(bits(word) & 0xFFFF == 0)  # each word is a BF16 value
    assert torch.equal(hi + (mid + lo), x)  # small words first, as the GEMMs add them


def test_special_values_give_special_hi_words():
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0])
    hi, lo = split_tf32(x)
    assert hi[0] == float("inf") and hi[1] == -float("inf") and torch.isnan(hi[2])
    assert torch.isnan(lo[:3]).all() and torch.equal(lo[3:], torch.zeros(2))
    bhi, bmid, blo = split_bf16x3(x)
    assert bhi[0] == float("inf") and torch.isnan(bhi[2]) and torch.isnan(bmid[:3]).all()


def test_nan_payloads_stay_nan():
    raw = torch.tensor([0x7F800001, 0x7FC00000, -1], dtype=torch.int32).view(torch.float32)
    assert torch.isnan(round_tf32(raw)).all()


def test_fp16x3_scaling_puts_each_row_maximum_at_the_top_of_fp16():
    x = torch.randn(7, 50) * torch.tensor([1e-30, 1e-20, 1.0, 3e4, 1e30, 0.0, 1e-40])[:, None]
    scaled, down = scale_rows(x)
    top = scaled.abs().amax(1)
    assert torch.all((top[:5] >= 2.0**14) & (top[:5] < 2.0**15)) and top[5] == 0
    assert 0 < top[6] < 2.0**14  # subnormal rows: the power of two stops at 2^126
    assert torch.equal(scaled * down[:, None], x)  # powers of two: exact
    hi, lo = split_fp16(scaled)
    assert torch.equal(hi, hi.half().float()) and torch.equal(lo, lo.half().float())
    assert torch.all((hi + lo - scaled).abs() <= 2.0**-23 * scaled.abs() + 2.0**-25)


def test_fp16_split_of_special_values():
    hi, lo = split_fp16(torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0]))
    assert hi[0] == float("inf") and hi[1] == -float("inf") and torch.isnan(hi[2]) and hi[3] == 0
    assert torch.equal(lo, torch.zeros(4))
