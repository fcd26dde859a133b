"""The backward pass of PET's folded compression input in one pass over memory (Triton).

The compression's first GEMM computes its folded edge embeddings in its epilogue
(:class:`.epilogue.Embedding`): ``z = x W^T + b + table[index] + geometry @ matrix^T`` and
``h = silu(z)``, with ``geometry`` [M, 4] each pair's vector and length. Given ``dh``
[M, N], the backward pass needs ``dz = silu'(z) dh`` (for the first layer's input gradient)
and ``d geometry = dz @ matrix`` [M, 4] (what reaches the positions). Eagerly that is
torch's ``silu_backward`` and then cuBLAS's [M, N] x [N, 4] product (~10 µs for the 6,400
rows of a 192-atom PET-S step on an H200, eager profile), each a pass over ``dz``. Here one
kernel (7.7 µs there, in a CUDA graph) reads ``z`` and ``dh`` once, writes ``dz`` and sums
each row's four products while the row is in registers.

Arithmetic as torch's CUDA ``silu_backward``, in FP32: ``s = 1 / (1 + exp(-z))`` with
libdevice's ``exp`` and ``dz = dh * s * (1 + z * (1 - s))``; the four sums over the N
columns are FP32 sums in a tree (the error of any FP32 summation order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .context import INTERPRETED, on_device

BLOCK_ROWS, BLOCK_COLUMNS = 16, 128
"""Each program takes 16 rows, 128 columns at a time (2,048 elements, 16 per thread in 4 warps)."""


@triton.jit
def _backward(
    z_ptr,
    dh_ptr,
    matrix_ptr,
    dz_ptr,
    dgeometry_ptr,
    rows,
    N,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLUMNS: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    s0 = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    s1, s2, s3 = s0, s0, s0
    for start in range(0, N, BLOCK_COLUMNS):
        c = start + tl.arange(0, BLOCK_COLUMNS)
        inside = (r[:, None] < rows) & (c[None, :] < N)
        at = r[:, None] * N + c[None, :]
        z = tl.load(z_ptr + at, mask=inside, other=0.0)
        dh = tl.load(dh_ptr + at, mask=inside, other=0.0)
        if LIBDEVICE:
            s = 1.0 / (1.0 + libdevice.exp(-z))
        else:  # the interpreter has no libdevice
            s = 1.0 / (1.0 + tl.exp(-z))
        dz = dh * s * (1.0 + z * (1.0 - s))
        tl.store(dz_ptr + at, dz, mask=inside)
        m = matrix_ptr + c * 4
        s0 += tl.sum(dz * tl.load(m, mask=c < N, other=0.0)[None, :], axis=1)
        s1 += tl.sum(dz * tl.load(m + 1, mask=c < N, other=0.0)[None, :], axis=1)
        s2 += tl.sum(dz * tl.load(m + 2, mask=c < N, other=0.0)[None, :], axis=1)
        s3 += tl.sum(dz * tl.load(m + 3, mask=c < N, other=0.0)[None, :], axis=1)
    inside = r < rows
    tl.store(dgeometry_ptr + r * 4, s0, mask=inside)
    tl.store(dgeometry_ptr + r * 4 + 1, s1, mask=inside)
    tl.store(dgeometry_ptr + r * 4 + 2, s2, mask=inside)
    tl.store(dgeometry_ptr + r * 4 + 3, s3, mask=inside)


def backward(grad_h: torch.Tensor, z: torch.Tensor, matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dz, d geometry)``: the gradients [M, N] by the pre-activation ``z`` [M, N] of
    ``h = silu(z)`` for ``grad_h`` [M, N], and [M, 4] by the ``geometry`` of ``z``'s term
    ``geometry @ matrix^T`` (``matrix`` [N, 4]). One kernel for float32 tensors on a GPU
    (or under Triton's interpreter), torch's steps otherwise."""
    rows, n = z.shape
    if z.dtype != torch.float32 or not (z.is_cuda or INTERPRETED) or matrix.shape != (n, 4):
        grad_z = torch.ops.aten.silu_backward(grad_h, z)
        return grad_z, grad_z @ matrix.to(grad_z.dtype)
    z, grad_h, matrix = z.contiguous(), grad_h.contiguous(), matrix.contiguous()
    grad_z, grad_geometry = torch.empty_like(z), z.new_empty(rows, 4)
    if rows:
        with on_device(z.device):
            _backward[(triton.cdiv(rows, BLOCK_ROWS),)](
                z, grad_h, matrix, grad_z, grad_geometry, rows, n, BLOCK_ROWS, BLOCK_COLUMNS, not INTERPRETED
            )
    return grad_z, grad_geometry
