import gzip
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import fp32_in_order
from hypothesis import given, settings
from hypothesis import strategies as st

from ase_tcfp32.tcmodel import PRESETS, custom, matmul, mma, round_to, tensor_core
from ase_tcfp32.tcmodel.formats import from_bits, to_bits

DATA = Path(__file__).parent / "data" / "tc_gpu_outputs"
U = 2.0**-24


def _hex_rows(path):
    with gzip.open(path, "rt") as f:
        return np.array([[int(t, 16) for t in line.split()] for line in f], dtype=np.uint32)


def _binary(path):
    with gzip.open(path, "rt") as f:
        return np.array([int(line.strip(), 2) for line in f], dtype=np.uint32)


CASES = [
    ("V100", "fp16", "fp32"),
    ("V100", "fp16", "fp16"),
    ("A100", "fp16", "fp32"),
    ("A100", "fp16", "fp16"),
    ("A100", "bf16", "fp32"),
    ("A100", "tf32", "fp32"),
]


@pytest.mark.parametrize("gpu,fmt,out", CASES)
def test_bit_exact_on_published_gpu_outputs(gpu, fmt, out):
    """Khattak & Mikaitis' measured V100/A100 outputs (5000 cases each), every bit."""
    folder = DATA / gpu / fmt
    a = from_bits(_hex_rows(folder / f"a_{gpu}_{fmt}.txt.gz"))
    b = from_bits(_hex_rows(folder / f"b_{gpu}_{fmt}.txt.gz"))
    c = from_bits(_binary(folder / f"c_{gpu}_fp32.txt.gz"))
    if out == "fp16":
        c = round_to(c, "fp16")  # the fp16-output kernels take c in fp16
    expected = _binary(folder / f"d_{gpu}_{out}.txt.gz")
    got = to_bits(mma(a, b, c, gpu=gpu, in_fmt=fmt, out_fmt=out))
    assert len(expected) == 5000
    mismatches = np.flatnonzero(got != expected)
    assert mismatches.size == 0, f"{mismatches.size} mismatches, first at case {mismatches[:5]}"


def _value(a, b, c, gpu, fmt):
    return float(
        matmul(np.array([a], dtype=float), np.array(b, dtype=float)[:, None], np.array([[c]]), gpu=gpu, in_fmt=fmt)[
            0, 0
        ]
    )


B200_RN = custom("B200-RN", "B200", final_rne=True)

# (a, b, c), in format, expected per GPU: the distinguishing vectors of docs/tcmodel.md
VECTORS = [
    (([U, U], [1, 1], 1.0), "fp16", {"V100": 1, "A100": 1 + 2 * U, "H100": 1 + 2 * U, "B200": 1 + 2 * U}),
    (([U, U, U], [1, 0.5, 0.5], 1.0), "bf16", {"A100": 1, "Ada": 1, "H100": 1 + 2 * U, "B200": 1 + 2 * U}),
    (([1, 1, 1], [1, 1, 1], 1 + 6 * U), "bf16", {"A100": 4, "H100": 4, "B200": 4, B200_RN: 4 + 8 * U}),
    (([0.5] * 4, [U] * 4, 1.0), "fp16", {"V100": 1, "A100": 1, "H100": 1 + 2 * U}),
    (([1.0], [1.0], -(1 - U)), "fp16", {"V100": 2 * U, "A100": U, "H100": U}),
    (([1, 1], [1, -U], -1 + U), "fp16", {"V100": 2 * U, "A100": 0.0, "H100": 0.0}),
    (([1, 0, 0, 0, 2 * U], [1, 0, 0, 0, 1], 1 + 2 * U), "tf32", {"A100": 2, "H100": 2 + 4 * U}),
    (([1, 0, 0, 0, 2 * U], [1, 0, 0, 0, 1], 1 + 2 * U), "bf16", {"A100": 2 + 4 * U, "H100": 2 + 4 * U}),
    (([1] + [0] * 7 + [2 * U], [1] + [0] * 7 + [1], 1 + 2 * U), "bf16", {"A100": 2, "H100": 2 + 4 * U}),
    (([1] + [0] * 7 + [2 * U], [1] + [0] * 7 + [1], 1 + 2 * U), "tf32", {"H100": 2, "B200": 2}),
    (([2.0**-76] * 16, [2.0**-76] * 16, 0.0), "bf16", {"A100": 2.0**-149, "H100": 2.0**-148, B200_RN: 2.0**-148}),
    (([2.0**-76] * 16, [2.0**-76] * 16, 0.0), "tf32", {"A100": 0.0, "H100": 2.0**-149}),
]


@pytest.mark.parametrize("vector,fmt,expected", VECTORS)
def test_distinguishing_vectors(vector, fmt, expected):
    for gpu, value in expected.items():
        assert _value(*vector, gpu, fmt) == value, (getattr(gpu, "name", gpu), fmt)


def test_fp8_paths_tell_hopper_from_blackwell_and_ada():
    """e4m3 keeps 13 fraction bits on Ada/Hopper, 25 on Blackwell tcgen05."""
    a = np.array([[1.0, 2.0**-9]])
    b = np.array([[1.0], [2.0**-9]])
    assert matmul(a, b, gpu="H100", in_fmt="e4m3")[0, 0] == 1.0
    assert matmul(a, b, gpu="Ada", in_fmt="e4m3")[0, 0] == 1.0
    assert matmul(a, b, gpu="B200", in_fmt="e4m3")[0, 0] == 1 + 2.0**-18


def test_every_pair_of_presets_is_told_apart():
    """For each pair of generations some test vector or supported format differs."""
    signature = {}
    for name, tc in PRESETS.items():
        parts = []
        for fmt in ("fp16", "bf16", "tf32", "e4m3"):
            if fmt not in tc.formats:
                parts.append(None)
                continue
            a = round_to(np.random.default_rng(1).standard_normal((8, 64)), fmt)
            b = round_to(np.random.default_rng(2).standard_normal((64, 8)), fmt)
            parts.append(to_bits(matmul(a, b, gpu=tc, in_fmt=fmt)).tobytes())
        signature[name] = tuple(parts)
    names = list(signature)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            assert signature[first] != signature[second], (first, second)


def test_aliases_and_custom_presets():
    assert tensor_core("H200") is PRESETS["H100"]
    assert tensor_core("A30") is PRESETS["A100"]
    wide = custom("wide", "A100", block=16)
    assert wide.params("bf16").block == 16 and wide.params("bf16").extra == 1
    with pytest.raises(ValueError, match="unknown GPU 'P100'"):
        tensor_core("P100")
    with pytest.raises(ValueError, match="take no 'tf32'"):
        mma([1.0], [1.0], gpu="V100", in_fmt="tf32")


def test_inputs_must_be_exact_in_their_format():
    with pytest.raises(ValueError, match="not exactly representable in fp16"):
        mma([0.1], [1.0], gpu="A100", in_fmt="fp16")


# --- special values -----------------------------------------------------------------


def test_special_values_and_signed_zero():
    inf, nan = np.inf, np.nan
    assert np.isnan(mma([inf, 1.0], [0.0, 1.0], 0.0, gpu="A100", in_fmt="fp16"))
    assert np.isnan(mma([inf, inf], [1.0, -1.0], 0.0, gpu="A100", in_fmt="fp16"))
    assert np.isnan(mma([nan], [1.0], 0.0, gpu="H100", in_fmt="bf16"))
    assert mma([inf], [2.0], 1.0, gpu="H100", in_fmt="bf16") == inf
    assert mma([1.0], [1.0], -inf, gpu="H100", in_fmt="bf16") == -inf
    zero = mma([1.0, -1.0], [1.0, 1.0], 0.0, gpu="A100", in_fmt="fp16")
    assert zero == 0 and not np.signbit(zero)
    # Inf persists across blocks of a chain
    a = np.array([[inf] + [1.0] * 15])
    assert matmul(a, np.ones((16, 1)), gpu="A100", in_fmt="bf16")[0, 0] == inf


def test_overflow_gives_inf_even_under_round_toward_zero():
    big = float(np.ldexp(1.0, 127))
    assert mma([big, big], [1.0, 1.0], 0.0, gpu="A100", in_fmt="bf16") == np.inf
    assert mma([big, -big, 1.0], [1.0, 1.0, 1.0], 0.0, gpu="A100", in_fmt="bf16") == 0.0  # +1 lost in alignment


# --- against exact rational arithmetic ----------------------------------------------


def _exact_block(a, b, c, gpu, fmt):
    """The block FMA written again with Fractions, one scalar case at a time."""
    p = tensor_core(gpu).params(fmt)
    emin = {"fp16": -14, "bf16": -126, "tf32": -126}[fmt]

    def expo(x, lo):
        x = abs(Fraction(x))
        e = 0
        while x >= 2:
            x, e = x / 2, e + 1
        while x < 1:
            x, e = x * 2, e - 1
        return max(e, lo)

    terms = [(Fraction(x) * Fraction(y), expo(x, emin) + expo(y, emin)) for x, y in zip(a, b) if x * y != 0]
    exps = [e for _, e in terms] + ([expo(c, -126)] if c != 0 else []) + [p.e_zero_fp32]
    e_max = max(exps)
    quantum = Fraction(2) ** (e_max - p.fraction)

    def trunc(v):
        q = abs(v) / quantum
        return (q.numerator // q.denominator) * quantum * (1 if v >= 0 else -1)

    total = trunc(Fraction(c)) + sum(trunc(v) for v, _ in terms)
    if total == 0:
        return 0.0
    e = expo(total, -126)
    step = Fraction(2) ** (e - 23)
    q = abs(total) / step
    return float((q.numerator // q.denominator) * step * (1 if total > 0 else -1))


@settings(max_examples=150, deadline=None)
@given(
    gpu=st.sampled_from(["V100", "A100", "H100"]),
    fmt=st.sampled_from(["fp16", "bf16", "tf32"]),
    data=st.data(),
)
def test_block_matches_exact_rational_arithmetic(gpu, fmt, data):
    tc = tensor_core(gpu)
    if fmt not in tc.formats:
        return
    k = data.draw(st.integers(1, tc.params(fmt).block))
    scale = data.draw(st.integers(-20, 12))  # fp16 stays finite
    values = st.floats(-4, 4, allow_nan=False, width=32)
    a = round_to(np.array(data.draw(st.lists(values, min_size=k, max_size=k))) * 2.0**scale, fmt)
    b = round_to(np.array(data.draw(st.lists(values, min_size=k, max_size=k))), fmt)
    c = float(np.float32(data.draw(values)))
    got = float(mma(a, b, c, gpu=gpu, in_fmt=fmt))
    assert got == _exact_block(a.tolist(), b.tolist(), c, gpu, fmt)


def test_chained_matmul_equals_blocks_applied_in_order():
    rng = np.random.default_rng(0)
    a = round_to(rng.standard_normal((3, 20)), "bf16")
    b = round_to(rng.standard_normal((20, 2)), "bf16")
    d = np.zeros((3, 2))
    for k0 in range(0, 20, 8):  # A100 bf16 blocks of 8
        for i in range(3):
            for j in range(2):
                d[i, j] = mma(a[i, k0 : k0 + 8], b[k0 : k0 + 8, j], d[i, j], gpu="A100", in_fmt="bf16")
    assert np.array_equal(matmul(a, b, gpu="A100", in_fmt="bf16"), d)


# --- previews of a GPU through the calculator ---------------------------------------


def test_emulated_tf32x3_is_fp32_level_and_differs_between_generations():
    from ase_tcfp32.tcmodel import emulated_matmul

    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 96)).astype(np.float32)
    w = rng.standard_normal((24, 96)).astype(np.float32)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    fp32_err = np.linalg.norm(fp32_in_order(x, w) - exact) / np.linalg.norm(exact)  # the same on every machine
    results = {gpu: emulated_matmul(x, w, "tf32x3", gpu) for gpu in ("A100", "H100", "B200")}
    for y in results.values():
        assert np.linalg.norm(y - exact) / np.linalg.norm(exact) < 3 * fp32_err
    assert not np.array_equal(results["A100"], results["H100"])
    assert np.array_equal(results["H100"], results["B200"])  # same TF32 arithmetic
    single = emulated_matmul(x, w, "tf32", "A100")
    assert np.linalg.norm(single - exact) / np.linalg.norm(exact) > 100 * fp32_err


def test_emulated_fp16x3_follows_the_kernel_and_keeps_fp32_range():
    """fp16x3 on the H100 model: FP32-level error on rows spanning 1e-20 ... 1e20, within
    FP32 rounding of the torch reference emulation (which sums in IEEE FP32), Inf/NaN
    propagated; A100 (8-product FP16 blocks) computes other bits. FP32's error is that of
    the in-order FP32 sum (not the local BLAS, whose error depends on the CPU)."""
    from ase_tcfp32._kernels.reference import ReferenceBackend
    from ase_tcfp32.tcmodel import emulated_matmul

    rng = np.random.default_rng(4)
    x = (rng.standard_normal((40, 100)) * 10.0 ** rng.integers(-20, 20, (40, 1))).astype(np.float32)
    w = rng.standard_normal((24, 100)).astype(np.float32)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    rel = lambda y, ref: np.linalg.norm(y - ref) / np.linalg.norm(ref)  # noqa: E731
    fp32_err = rel(fp32_in_order(x, w), exact)
    y = emulated_matmul(x, w, "fp16x3", "H100")
    assert rel(y, exact) < 2 * fp32_err
    reference = ReferenceBackend("fp16x3")
    y_ref = reference.forward(torch.from_numpy(x), reference.prepare(torch.from_numpy(w)), None).numpy()
    assert rel(y, y_ref.astype(np.float64)) < fp32_err
    assert not np.array_equal(y, emulated_matmul(x, w, "fp16x3", "A100"))
    x[0, 3], x[1, 5] = np.inf, np.nan
    y = emulated_matmul(x, w, "fp16x3", "H100")
    expected = x @ w.T
    assert np.array_equal(np.isinf(y), np.isinf(expected)) and np.array_equal(np.isnan(y), np.isnan(expected))


def test_calculator_previews_a_gpu_on_cpu(tiny_ckpt, water):
    from ase_tcfp32 import TCPETCalculator

    water.calc = TCPETCalculator(tiny_ckpt, precision="fp32", device="cpu")
    e32, f32 = water.get_potential_energy(), water.get_forces()
    calc = TCPETCalculator(tiny_ckpt, precision="tf32x3", emulate="A100")
    assert calc.backend == "tcmodel:A100" and calc.device.type == "cpu"
    water.calc = calc
    assert abs(water.get_potential_energy() - e32) / len(water) < 2e-6
    assert np.abs(water.get_forces() - f32).max() < 5e-6


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(precision="fp32", emulate="A100"), "needs precision 'tf32', 'tf32x3', 'fp16x3' or 'bf16x9'"),
        (dict(precision="tf32x3", emulate="P100"), "unknown GPU 'P100'"),
        (dict(precision="tf32x3", emulate="A100", device="cuda"), "runs the tensor-core model on CPU"),
    ],
)
def test_emulate_rejects_bad_combinations(tiny_ckpt, kwargs, message):
    from ase_tcfp32 import TCPETCalculator

    with pytest.raises(ValueError, match=message):
        TCPETCalculator(tiny_ckpt, **kwargs)
