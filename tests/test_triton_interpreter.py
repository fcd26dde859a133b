"""The TF32 Triton kernels' indexing, masking, bias and Inf/NaN logic, run on CPU
through Triton's interpreter (which computes the dots in FP32 numpy, so it checks the
kernel's logic, not tensor-core rounding; BF16 dots are not supported there)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from ase_tcfp32.kernels.reference import ReferenceBackend
    from ase_tcfp32.kernels.triton_gemm import TritonBackend

    g = torch.Generator().manual_seed(0)
    for precision in ("tf32", "tf32x3"):
        triton_, ref = TritonBackend(precision), ReferenceBackend(precision)
        for m, k, n in [(0, 20, 8), (1, 64, 5), (37, 40, 20), (130, 17, 33), (129, 70, 130), (200, 4, 16)]:
            x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
            if m > 2:
                x[1, 3], x[2, 0] = float("inf"), float("nan")
            if m == 129:  # a non-finite weight takes the kernel's output-masking branch
                w[5, 2] = -float("inf")
            y = triton_.forward(x, triton_.prepare(w), b)
            expected = x @ w.T + b
            assert y.shape == (m, n)
            assert torch.equal(torch.isnan(y), torch.isnan(expected)), (precision, m, k, n)
            assert torch.equal(torch.isinf(y), torch.isinf(expected)), (precision, m, k, n)
            finite = torch.isfinite(expected)
            tol = 2e-2 if precision == "tf32" else 1e-5
            assert torch.allclose(y[finite], expected[finite], rtol=tol, atol=tol), (precision, m, k, n)
            grad = torch.randn(m, n, generator=g)
            dx = triton_.grad_input(grad, triton_.prepare(w))
            assert torch.allclose(dx, grad @ w, rtol=tol, atol=tol), (precision, m, k, n)
    print("interpreter kernels ok")
    """
)


def test_tf32_kernels_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "interpreter kernels ok" in result.stdout
