"""Products with few output columns, in FP32 on CUDA cores (Triton): PET's heads' last layers.

A head's last layer maps its features [M, K] (K = d_head, 128-640) to 1, 3 or 9 outputs
(energy, direct forces, direct stress). That is too narrow for the tensor-core kernels
(:data:`~.triton_gemm.MIN_OUTPUTS`), and cuBLAS FP32 runs it well on large inputs but not
on small ones: in a 192-atom PET-S step (H200, CUDA graph) its large-K kernel took 19-22 µs
per launch, where reading a [6,400 x 256] input takes ~1.4 µs.
Here each program takes a block of rows (:data:`LAUNCHES`), all N outputs (padded to 16), and
walks K in FP32 fused multiply-adds (``tl.dot`` with ``input_precision="ieee"``): plain FP32
arithmetic, as accurate as cuBLAS's FP32, one pass over the input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .context import INTERPRETED, on_device

OUTPUTS = 16
"""The most outputs a launch takes."""

LAUNCHES = ((2048, 16, 64, 4), (65536, 64, 64, 2), (None, 64, 32, 1))
"""``(up to M rows, rows per program, terms per step of the K loop, warps)``: small blocks that
spread a few hundred rows over the GPU, one warp per 64 rows where there are enough of them to
fill it. On an H200 (in CUDA graphs, PET-S's K = 256), the same run against the single launch
of 64 rows, 32 terms and 4 warps this replaced: [192 x 256] -> 1 and -> 9 12.4 and 12.8 -> 6.3
and 6.4 µs, [6,400 x 256] -> 1 and -> 9 12.8 and 13.2 -> 9.1 and 10.7 µs, [547,178 x 256] -> 1
(17,280 atoms' edges) 711 -> 322 µs (its input is read in 117 µs at the memory bandwidth;
``docs/design.md``)."""

MIN_TERMS = 8
"""The fewest terms per output (K) this kernel takes: fewer are an outer product, left to torch."""


@triton.jit
def _narrow(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_x,
    HAS_BIAS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_TERMS: tl.constexpr,
    OUTPUTS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, OUTPUTS)
    acc = tl.zeros([BLOCK_ROWS, OUTPUTS], dtype=tl.float32)
    for start in range(0, K, BLOCK_TERMS):
        k = start + tl.arange(0, BLOCK_TERMS)
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0
        )
        w = tl.load(w_ptr + cols[None, :] * K + k[:, None], mask=(cols[None, :] < N) & (k[:, None] < K), other=0.0)
        acc = tl.dot(x, w, acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0)[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` runs the kernel for ``x`` [M, K] and ``weight`` [N, K]: float32
    on a GPU (or under Triton's interpreter), 1 to :data:`OUTPUTS` outputs, :data:`MIN_TERMS`
    terms or more."""
    return (
        x.dtype == weight.dtype == torch.float32
        and (x.is_cuda or INTERPRETED)
        and x.dim() == 2
        and 0 < weight.shape[0] <= OUTPUTS
        and weight.shape[1] >= MIN_TERMS
    )


def launch_config(m: int) -> tuple[int, int, int]:
    """``(rows per program, terms per step, warps)`` for ``m`` rows (:data:`LAUNCHES`)."""
    return next((rows, terms, warps) for most, rows, terms, warps in LAUNCHES if most is None or m <= most)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ weight.T + bias`` -> [M, N] in FP32: the kernel where :func:`usable`,
    torch's ``linear`` (cuBLAS FP32 on a GPU) otherwise."""
    if not usable(x, weight):
        return torch.nn.functional.linear(x, weight, bias)
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = x.new_empty(m, n)
    weight = weight.detach().contiguous()
    bias = None if bias is None else bias.detach().contiguous()
    if m:
        rows, terms, warps = launch_config(m)
        with on_device(x.device):
            _narrow[(triton.cdiv(m, rows),)](
                x,
                weight,
                weight if bias is None else bias,
                y,
                m,
                n,
                k,
                x.stride(0),
                bias is not None,
                rows,
                terms,
                OUTPUTS,
                num_warps=warps,
            )
    return y
