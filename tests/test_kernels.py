"""The GEMM kernels (ase_tcfp32._kernels: triton_gemm, fp16x3 and the cuBLAS call) on the
GPU against FP64, the reference emulation and cuBLAS FP32 (pytest -m gpu tests; skipped
without CUDA)."""

import pytest
import torch
from helpers import check_narrow, rel_error

from ase_tcfp32._kernels import narrow
from ase_tcfp32._kernels.reference import ReferenceBackend
from ase_tcfp32._kernels.triton_gemm import SMALL_ROWS, parts, small, tile_config
from ase_tcfp32.precision import support

pytestmark = pytest.mark.gpu

PRECISIONS = ["tf32", "tf32x3", "bf16x9"]
SMALL = dict(tile_config(256, 256), **small(SMALL_ROWS))  # the Triton kernel's tiles for few rows


def assert_fp32_level(err: float, fp32: float, depth: int, factor: float) -> None:
    """Error ``err`` of an emulated GEMM vs cuBLAS FP32's ``fp32`` (both vs FP64): at most
    ``factor`` times it when the contraction is 256 or longer; on shorter ones at most
    twice it or 4 units of FP32 roundoff (2^-22): the tensor cores truncate the sums of
    each K-tile's accumulator, and few terms make cuBLAS's own error unusually small."""
    assert err <= (factor * fp32 if depth >= 256 else max(2 * fp32, 2.0**-22)), (err, fp32)


@pytest.fixture(scope="module")
def triton_backends():
    from ase_tcfp32._kernels.triton_gemm import TritonBackend

    return {p: TritonBackend(p) for p in PRECISIONS}


def run(backend, x, w, b=None):
    return backend.forward(x, backend.prepare(w), b)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(
    "shape",
    [(0, 64, 32), (1, 16, 4), (1003, 17, 33), (4099, 128, 384), (777, 1024, 257), (300, 2048, 2048), (5000, 256, 768)],
)
def test_triton_matches_reference_and_fp64(triton_backends, precision, shape):
    m, k, n = shape
    g = torch.Generator(device="cuda").manual_seed(m + k + n)
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g)
    b = torch.randn(n, device="cuda", generator=g)
    y = run(triton_backends[precision], x, w, b)
    ref = ReferenceBackend(precision)
    y_ref = ref.forward(x, ref.prepare(w), b)
    assert y.shape == (m, n)
    if m == 0:
        return
    exact = x.double() @ w.double().T + b.double()
    baseline = torch.nn.functional.linear(x, w, b)  # cuBLAS FP32, as nn.Linear runs it
    fp32 = rel_error(baseline, exact)
    err, err_ref = rel_error(y, exact), rel_error(y_ref, exact)
    if precision == "tf32":
        assert 1e-5 < err < 2e-3
    elif m < triton_backends[precision].prepare(w).forward.min_rows and (
        precision == "bf16x9" or not parts(m, n, k, x.device, SMALL)
    ):
        # light or narrow, with rows too few to fill the GPU: FP32 itself (narrow products in
        # the narrow kernel, the rest in cuBLAS: narrow.linear gives either)
        assert torch.equal(y, narrow.linear(x, w, b))
    else:
        assert err <= max(2 * err_ref, 2 * fp32), (err, err_ref, fp32)
        if k >= 256:
            assert err <= fp32 * 1.05, (err, fp32)  # no worse than cuBLAS FP32


@pytest.mark.parametrize("precision", PRECISIONS)
def test_triton_backward_matches_fp64(triton_backends, precision):
    backend = triton_backends[precision]
    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(768, 256, device="cuda", generator=g)
    gy = torch.randn(20000, 768, device="cuda", generator=g)
    dx = backend.grad_input(gy, backend.prepare(w))
    exact = gy.double() @ w.double()
    err = rel_error(dx, exact)
    assert err < (2e-3 if precision == "tf32" else rel_error(gy @ w, exact) * 1.05)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("inf_weight", [False, True])
def test_triton_inf_nan_propagate_like_torch(triton_backends, precision, inf_weight):
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(300, 100, device="cuda", generator=g)
    w = torch.randn(50, 100, device="cuda", generator=g)
    if inf_weight:
        w[7, 50] = float("inf")
    x[0, 3], x[1, 7], x[2, 0] = float("inf"), -float("inf"), float("nan")
    w[4, 3] = 0.0
    x[3, 10] = x[3, 11] = float("inf")
    w[:, 11] = -w[:, 10]
    y, expected = run(triton_backends[precision], x, w), x @ w.T
    assert torch.equal(torch.isnan(y), torch.isnan(expected))
    assert torch.equal(torch.isinf(y), torch.isinf(expected))
    assert torch.equal(y[torch.isinf(expected)], expected[torch.isinf(expected)])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_tma_and_pointer_loads_give_the_same_bits(triton_backends, precision):
    """On Hopper x comes in through a TMA descriptor when its rows are 16-byte aligned,
    through pointer loads otherwise: the arithmetic is the same, so are the results."""
    from ase_tcfp32._kernels.triton_gemm import _tma_ready, launch

    g = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(384, 256, device="cuda", generator=g)
    x = torch.randn(20000, 256, device="cuda", generator=g)
    padded = torch.zeros(20000, 257, device="cuda")
    padded[:, :256] = x
    unaligned = padded[:, :256]  # rows of 257 floats: not 16-byte aligned
    assert _tma_ready(x) and not _tma_ready(unaligned)
    gemm = triton_backends[precision].prepare(w).forward
    assert (gemm.descriptor is not None) == (torch.cuda.get_device_capability()[0] >= 9)
    assert torch.equal(launch(x, gemm), launch(unaligned, gemm))


def test_huge_m_uses_64_bit_offsets(triton_backends):
    m = 10_000_000
    x = torch.randn(m, 256, device="cuda")  # 10 GB: offsets past 2**31
    w = torch.randn(16, 256, device="cuda")
    y = run(triton_backends["tf32x3"], x, w)
    rows = torch.tensor([0, 1, m // 2, m - 2, m - 1], device="cuda")
    exact = x[rows].double() @ w.double().T
    assert rel_error(y[rows], exact) < 1e-6


def test_cublas_bf16x9_call_reaches_cublas():
    """The ctypes path runs, its strategy reaches the handle and is restored; on Hopper
    cuBLAS ignores the emulated compute type and returns SGEMM's bits (measured)."""
    from ase_tcfp32._kernels import cublas

    handle = torch.cuda.current_blas_handle()
    before = cublas.get_strategy(handle)
    cublas.set_strategy(handle, cublas.STRATEGIES["eager"])
    assert cublas.get_strategy(handle) == cublas.STRATEGIES["eager"]
    cublas.set_strategy(handle, before)
    x = torch.randn(513, 256, device="cuda")
    w = torch.randn(130, 256, device="cuda")
    y = cublas.gemm_bf16x9(x, w, transpose_b=True, strategy="eager")
    assert cublas.get_strategy(handle) == before
    dx = cublas.gemm_bf16x9(y, w, transpose_b=False)
    exact = x.double() @ w.double().T
    assert rel_error(y, exact) < 1e-6
    assert rel_error(dx, y.double() @ w.double()) < 1e-6
    if torch.cuda.get_device_capability() < (10, 0):
        assert torch.equal(y, x @ w.T)


def test_gemms_with_few_rows_run_small_tiles_in_parts_and_light_ones_cublas_fp32(triton_backends):
    """192-atom node layers (16-48 tiles of 128 rows on 132 SMs) run 64-row tiles summed in
    parts in tf32x3, at FP32's error level against FP64, cuBLAS FP32 in bf16x9; light
    products (under 2^27 multiply-adds) run cuBLAS FP32; single-pass tf32 stays TF32."""
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(192, 2048, device="cuda", generator=g)
    w = torch.randn(1024, 2048, device="cuda", generator=g)
    exact = x.double() @ w.double().T
    fp32 = rel_error(x @ w.T, exact)
    y = run(triton_backends["tf32x3"], x, w)
    assert not torch.equal(y, x @ w.T)
    assert_fp32_level(rel_error(y, exact), fp32, 2048, 1.25)
    assert torch.equal(run(triton_backends["bf16x9"], x, w), x @ w.T)
    light_x, light_w = x[:, :256].contiguous(), w[:256, :256].contiguous()
    assert torch.equal(run(triton_backends["tf32x3"], light_x, light_w), light_x @ light_w.T)
    assert not torch.equal(run(triton_backends["tf32"], x, w), x @ w.T)  # single pass stays TF32


def test_narrow_products_run_fp32_on_cuda_cores(triton_backends, fp16x3):
    """The heads' last layers (1, 3 or 9 outputs): :func:`helpers.check_narrow` on the GPU,
    and both tensor-core backends send them there."""
    check_narrow("cuda")
    x, w, b = (torch.randn(*shape, device="cuda") for shape in ((6400, 256), (3, 256), (3,)))
    for backend in (triton_backends["tf32x3"], fp16x3.Fp16x3Backend()):
        assert torch.equal(run(backend, x, w, b), narrow.linear(x, w, b))


FP16X3_CONFIGS = {"bk32": dict(BK=32, STAGES=4), "bk64": dict(BK=64, STAGES=2), "bk16": dict(BK=16, STAGES=6)}


@pytest.fixture(scope="module")
def fp16x3():
    fp16x3_support = support("fp16x3", "cuda")
    if not fp16x3_support.available:
        pytest.skip(fp16x3_support.note)
    from ase_tcfp32._kernels import fp16x3

    return fp16x3


@pytest.mark.parametrize("data", ["normal", "wide"])
@pytest.mark.parametrize(
    "shape", [(1003, 17, 33), (4099, 128, 384), (5000, 256, 768), (20_000, 33, 130), (70_000, 512, 256)]
)
@pytest.mark.parametrize("config", FP16X3_CONFIGS)
def test_fp16x3_kernel_matches_fp64(fp16x3, config, shape, data):
    """Ragged shapes (TMA zero-fill, masked stores), forward with bias and backward.
    ``wide``: every row of x and of w scaled by its own power of ten (1e-15 ... 1e15),
    every third row of x spread over e^(+-9). Error vs FP64: :func:`assert_fp32_level`,
    at most cuBLAS FP32's (1.25x on wide data) at contractions of 256 and longer (measured
    up to 3x cuBLAS FP32 at K = 17)."""
    config = dict(fp16x3.CONFIG, **FP16X3_CONFIGS[config])
    m, k, n = shape
    g = torch.Generator(device="cuda").manual_seed(m + k + n)
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
    if data == "wide":
        x *= 10.0 ** torch.randint(-15, 15, (m, 1), device="cuda", generator=g)
        x[::3] *= torch.exp(3 * torch.randn(x[::3].shape, device="cuda", generator=g))
        w *= 10.0 ** torch.randint(-15, 15, (n, 1), device="cuda", generator=g)
    b = torch.randn(n, device="cuda", generator=g) * w.abs().amax(1)
    gy = torch.randn(m, n, device="cuda", generator=g)
    exact, exact_dx = x.double() @ w.double().T + b.double(), gy.double() @ w.double()
    y = fp16x3.launch(x, fp16x3.split_weight(w), b, config)
    dx = fp16x3.launch(gy, fp16x3.split_weight(w.T.contiguous()), None, config)
    for err, fp32, depth in [
        (rel_error(y, exact), rel_error(x @ w.T + b, exact), k),
        (rel_error(dx, exact_dx), rel_error(gy @ w, exact_dx), n),
    ]:
        assert_fp32_level(err, fp32, depth, 1.0 if data == "normal" else 1.25)


def test_fp16x3_kernel_matches_the_reference_emulation(fp16x3):
    """The kernel and the torch emulation of :mod:`reference` compute the same split
    and products; they differ by the tensor cores' truncated sums only."""
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(9000, 256, device="cuda", generator=g) * 10.0 ** torch.randint(
        -10, 10, (9000, 1), device="cuda", generator=g
    )
    w = torch.randn(384, 256, device="cuda", generator=g)
    reference = ReferenceBackend("fp16x3")
    y_ref = reference.forward(x, reference.prepare(w), None)
    y = fp16x3.launch(x, fp16x3.split_weight(w))
    exact = x.double() @ w.double().T
    assert rel_error(y, y_ref.double()) <= rel_error(x @ w.T, exact)


def test_fp16x3_inf_nan_propagate_like_torch(fp16x3):
    x = torch.randn(20_000, 64, device="cuda")  # enough rows for the kernel (min_rows)
    w = torch.randn(128, 64, device="cuda")
    x[3, 5], x[7, 9], x[11, 0] = float("inf"), float("-inf"), float("nan")
    expected = x @ w.T
    backend = fp16x3.Fp16x3Backend()
    y = backend.forward(x, backend.prepare(w), None)
    assert torch.equal(torch.isnan(y), torch.isnan(expected))
    assert torch.equal(torch.isinf(y), torch.isinf(expected))


@pytest.mark.parametrize("shape", [(192, 1024, 4096), (192, 4096, 1024), (100, 2048, 1040), (7000, 256, 128)])
def test_fp16x3_products_summed_in_parts_match_fp64(fp16x3, shape):
    """Each output tile summed in 2, 4 or 8 parts of its K-tiles (ragged rows, columns and
    parts; with the bias in one part only): FP32's error level, forward and backward, with
    64- and 128-row tiles; replayed in a CUDA graph, the same bits. A count that would leave
    a part empty is refused."""
    m, k, n = shape
    g = torch.Generator(device="cuda").manual_seed(m + k + n)
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
    b = torch.randn(n, device="cuda", generator=g)
    gy = torch.randn(m, n, device="cuda", generator=g)
    exact, exact_dx = x.double() @ w.double().T + b.double(), gy.double() @ w.double()
    fp32, fp32_dx = rel_error(x @ w.T + b, exact), rel_error(gy @ w, exact_dx)
    words, words_t = fp16x3.split_weight(w), fp16x3.split_weight(w.T.contiguous())
    for splits in (2, 4, 8):
        for config in (fp16x3.SMALL, fp16x3.CONFIG):
            for operand, split, exact_y, reference, depth, bias in [
                (x, words, exact, fp32, k, b),
                (gy, words_t, exact_dx, fp32_dx, n, None),
            ]:
                tiles = -(-depth // 32)
                if (splits - 1) * -(-tiles // splits) >= tiles:
                    with pytest.raises(ValueError, match="empty"):
                        fp16x3.launch(operand, split, bias, config, splits=splits)
                    continue
                y = fp16x3.launch(operand, split, bias, config, splits=splits)
                assert y.shape == exact_y.shape
                assert_fp32_level(rel_error(y, exact_y), reference, depth, 1.0)
    y = fp16x3.launch(x, words, b, fp16x3.SMALL, splits=2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fp16x3.launch(x, words, b, fp16x3.SMALL, splits=2)
    graph.replay()
    assert torch.equal(replayed, y)


@pytest.mark.parametrize(
    "epilogue", ["plain", "bias", "residual", "silu", "swiglu", "silu keep", "swiglu keep", "rms", "rms swiglu"]
)
def test_fp16x3_small_tiles_give_the_bits_of_the_tuned_ones(fp16x3, epilogue):
    """SMALL (64-row tiles, one part) sums every output in the K-tiles and order of CONFIG:
    the same bits with every epilogue, ragged rows and columns."""
    m, k, n = 333, 264, 208
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(m, k, device="cuda", generator=g)
    words = fp16x3.split_weight(torch.randn(n, k, device="cuda", generator=g) / k**0.5)
    options = {"bias": torch.randn(n, device="cuda", generator=g)} if epilogue != "plain" else {}
    if epilogue == "residual":
        options["residual"] = torch.randn(m, n, device="cuda", generator=g)
    for name in ("silu", "swiglu"):
        if name in epilogue:
            options["activation"] = name
    options["keep"] = "keep" in epilogue
    if "rms" in epilogue:
        options["rms_eps"] = 1e-5
    small = fp16x3.launch(x, words, config=fp16x3.SMALL, **options)
    tuned = fp16x3.launch(x, words, config=fp16x3.CONFIG, **options)
    for a, b in zip(small if options["keep"] else [small], tuned if options["keep"] else [tuned]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("m, n, k", [(192, 256, 512), (192, 64, 256), (4608, 64, 64)])
def test_the_fp16x3_backend_runs_light_products_on_small_tiles(fp16x3, m, n, k):
    """Products from 2^20 multiply-adds on run fp16x3, not cuBLAS FP32: the bundled demo
    model's (d_pet 64) at 192 atoms, its node feed-forward's second layer, its heads' first
    layers and its edge layers; same error level as FP32 in both directions."""
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
    b = torch.randn(n, device="cuda", generator=g)
    gy = torch.randn(m, n, device="cuda", generator=g)
    backend = fp16x3.Fp16x3Backend()
    prepared = backend.prepare(w)
    y, dx = fp16x3._product(x, prepared.forward, b), fp16x3._product(gy, prepared.backward)
    assert y is not None and dx is not None  # None: cuBLAS FP32 would run them
    exact, exact_dx = x.double() @ w.double().T + b.double(), gy.double() @ w.double()
    assert_fp32_level(rel_error(y, exact), rel_error(x @ w.T + b, exact), k, 1.0)
    assert_fp32_level(rel_error(dx, exact_dx), rel_error(gy @ w, exact_dx), n, 1.0)


@pytest.mark.parametrize("n, k", [(4096, 1024), (256, 1024)])  # the node update's first layer, the center contraction
def test_the_fp16x3_backend_runs_small_node_layers_on_small_tiles(fp16x3, n, k):
    """192 rows of PET-S's node layers (too few for the tuned tiles, min_rows) run SMALL
    tiles (in parts where they fit), not cuBLAS FP32, down to the center contraction's
    [192 x 1024] -> 256 (lighter than tf32x3's 2^27 multiply-adds); same error level."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(192, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
    b = torch.randn(n, device="cuda", generator=g)
    gy = torch.randn(192, n, device="cuda", generator=g)
    backend = fp16x3.Fp16x3Backend()
    prepared = backend.prepare(w)
    assert 192 < prepared.forward.min_rows and 192 < prepared.backward.min_rows
    assert fp16x3.parts(192, n, k, x.device, fp16x3.SMALL, fp16x3.MIN_SMALL_WORK) >= 1
    assert fp16x3.parts(192, k, n, x.device, fp16x3.SMALL, fp16x3.MIN_SMALL_WORK) > 1
    y, dx = backend.forward(x, prepared, b), backend.grad_input(gy, prepared)
    assert not torch.equal(y, torch.nn.functional.linear(x, w, b)) and not torch.equal(dx, gy @ w)
    exact, exact_dx = x.double() @ w.double().T + b.double(), gy.double() @ w.double()
    assert_fp32_level(rel_error(y, exact), rel_error(x @ w.T + b, exact), k, 1.0)
    assert_fp32_level(rel_error(dx, exact_dx), rel_error(gy @ w, exact_dx), n, 1.0)


FIRST_BACKWARD = """
import sys, torch
from ase_tcfp32 import tc_linear
precision = sys.argv[1]
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(32768, 512, device="cuda", generator=g, requires_grad=True)
w = torch.randn(256, 512, device="cuda", generator=g)
gy = torch.randn(32768, 256, device="cuda", generator=g)
y = tc_linear(x, w, None, precision=precision)
(dx,) = torch.autograd.grad(y, x, gy)  # runs on autograd's CUDA worker thread
exact = gy.double() @ w.double()
err = ((dx.double() - exact).norm() / exact.norm()).item()
fp32 = ((gy @ w).double() - exact).norm().item() / exact.norm().item()
print(precision, err, fp32)
assert err <= 1.05 * fp32, (err, fp32)
"""


@pytest.mark.parametrize("precision", ["tf32x3", "fp16x3", "bf16x9"])
def test_first_backward_in_a_fresh_process_with_empty_caches(tmp_path, precision):
    """Issue 25, case 1: the first backward of a fresh process, tuning from an empty cache
    and launching on autograd's worker thread (failed with 'Failed to create tensor map
    descriptor: invalid device context' before the context was bound per thread)."""
    import os
    import subprocess
    import sys

    if precision == "fp16x3" and not support("fp16x3", "cuda").available:
        pytest.skip("fp16x3 needs Hopper")
    env = dict(os.environ, ASE_TCFP32_CACHE=str(tmp_path / "cache"), TRITON_CACHE_DIR=str(tmp_path / "triton"))
    env.pop("ASE_TCFP32_AUTOTUNE", None)
    done = subprocess.run(
        [sys.executable, "-c", FIRST_BACKWARD, precision], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "cache" / "autotune.json").exists()  # it did tune
