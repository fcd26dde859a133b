"""PET's SwiGLU activation in one pass over memory, forward and backward (Triton).

metatrain's ``FeedForward`` splits its input projection's output ``y`` [M, 2F] into a
value ``v`` and a gate ``g`` (``y.chunk(2, -1)``) and computes ``h = v * sigmoid(g)``
[M, F]. Eagerly that is two kernels forward and four backward (``mul``, ``mul``,
``sigmoid_backward`` and the ``cat`` that reassembles ``chunk``'s gradient), each a pass
over tensors of M x F floats: at 17,280 water atoms with PET-S, M = 673,920 edge tokens
and F = 512, 1.4 GB per tensor. Here the forward reads ``y`` once and writes ``h``; the
backward reads ``y`` and ``dh`` once and writes ``dy`` [M, 2F] whole.

Arithmetic as torch's CUDA kernels do it, in FP32: ``sigmoid(g) = 1 / (1 + exp(-g))``
with libdevice's ``exp`` (CUDA's ``expf``: at most 2 units in the last place), not
Triton's approximate one; ``dv = dh * s`` and ``dg = (dh * v) * (1 - s) * s``. Non-finite
inputs propagate as in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .context import INTERPRETED, on_device

BLOCK_ROWS, BLOCK_COLUMNS = 16, 256
"""Each program takes a [16, 256] tile of ``h`` (4,096 elements, 8 per thread in 4 warps)."""


@triton.jit
def _tile(y_ptr, rows, F, BLOCK_ROWS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr):
    """The tile's offsets into ``h`` and into ``y``'s value half, its mask, ``v`` and ``g``."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]
    c = tl.program_id(1) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)[None, :]
    inside = (r < rows) & (c < F)
    at_y = r * (2 * F) + c
    v = tl.load(y_ptr + at_y, mask=inside, other=0.0)
    g = tl.load(y_ptr + at_y + F, mask=inside, other=0.0)
    return r * F + c, at_y, inside, v, g


@triton.jit
def _sigmoid(g, LIBDEVICE: tl.constexpr):
    """``1 / (1 + exp(-g))``. Triton's FP32 ``tl.exp`` is ``ex2.approx`` of ``g * log2(e)``
    (errors of ~|g| units in the last place); the interpreter has no libdevice."""
    if LIBDEVICE:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    return 1.0 / (1.0 + e)


@triton.jit
def _swiglu_forward(
    y_ptr, h_ptr, rows, F, BLOCK_ROWS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr, LIBDEVICE: tl.constexpr
):
    at_h, _, inside, v, g = _tile(y_ptr, rows, F, BLOCK_ROWS, BLOCK_COLUMNS)
    tl.store(h_ptr + at_h, v * _sigmoid(g, LIBDEVICE), mask=inside)


@triton.jit
def _swiglu_backward(
    y_ptr, dh_ptr, dy_ptr, rows, F, BLOCK_ROWS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr, LIBDEVICE: tl.constexpr
):
    at_h, at_y, inside, v, g = _tile(y_ptr, rows, F, BLOCK_ROWS, BLOCK_COLUMNS)
    dh = tl.load(dh_ptr + at_h, mask=inside, other=0.0)
    s = _sigmoid(g, LIBDEVICE)
    tl.store(dy_ptr + at_y, dh * s, mask=inside)
    tl.store(dy_ptr + at_y + F, (dh * v) * (1.0 - s) * s, mask=inside)


def _launch(y: torch.Tensor) -> tuple:
    """``(rows, F, grid)`` for ``y`` [..., 2F] float32, contiguous (checked first)."""
    if y.dtype != torch.float32 or not y.is_contiguous() or y.shape[-1] % 2:
        raise ValueError(f"a contiguous float32 [..., 2F] tensor expected, got {y.dtype} {tuple(y.shape)}")
    features = y.shape[-1] // 2
    rows = y.numel() // y.shape[-1] if y.shape[-1] else 0
    return rows, features, (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(features, BLOCK_COLUMNS))


def forward(y: torch.Tensor) -> torch.Tensor:
    """``v * sigmoid(g)`` ``[..., F]`` for ``y = [v, g]`` ``[..., 2F]``."""
    rows, features, grid = _launch(y)
    h = y.new_empty(*y.shape[:-1], features)
    if rows and features:
        with on_device(y.device):
            _swiglu_forward[grid](y, h, rows, features, BLOCK_ROWS, BLOCK_COLUMNS, not INTERPRETED)
    return h


def backward(grad_h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient [..., 2F] of :func:`forward` with respect to ``y``, for ``grad_h`` [..., F]."""
    rows, features, grid = _launch(y)
    grad_h = grad_h.contiguous()
    grad_y = torch.empty_like(y)
    if rows and features:
        with on_device(y.device):
            _swiglu_backward[grid](y, grad_h, grad_y, rows, features, BLOCK_ROWS, BLOCK_COLUMNS, not INTERPRETED)
    return grad_y
