"""A pre-norm residual branch in one pass each way (Triton): ``x`` feeds both a residual
addition and, through an RMS norm, the next layer.

PET-MAD's transformer layers (PreLN) compute ``x + f(RMSNorm(x))`` twice per layer, on the
edge tokens [R, d] and the node features. Eagerly the backward pass then runs the norm's
backward (reads x and dy, writes a gradient) and autograd adds it to the residual's
gradient (reads two, writes one): two passes over [R, d] where one does. Here
:func:`backward` reads x, dy and the residual's gradient once and writes ``dx``;
:func:`forward` writes the normed rows and each row's ``rstd`` for it.

Arithmetic in FP32 as torch's ``rms_norm`` defines it: ``rstd = 1 / sqrt(sum(x^2) / d +
eps)``, ``y = x * rstd * w``; backward, with ``g = dy * w``: ``dx = rstd * g - x * rstd^3 *
sum(g * x) / d + dr``. The weight gets no gradient (the calculator's model is frozen).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .context import on_device


def rows_per_program(width: int) -> int:
    """Rows of x [R, ``width``] per program: 2,048 lanes' worth (at least one row)."""
    return max(1, 2048 // triton.next_power_of_2(max(width, 16)))


@triton.jit
def _rows(x_ptr, w_ptr, R, D: tl.constexpr, DP: tl.constexpr, ROWS: tl.constexpr):
    """This program's rows of x [R, D] as [ROWS, DP] (zero outside), their offsets, mask and the weight [DP]."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, DP)[None, :]
    where = (rows < R) & (c < D)
    at = rows * D + c
    x = tl.load(x_ptr + at, mask=where, other=0.0)
    w = tl.load(w_ptr + c, mask=c < D, other=0.0)
    return x, w, at, where, rows


@triton.jit
def _rms_norm_forward(x_ptr, w_ptr, y_ptr, rstd_ptr, R, eps, D: tl.constexpr, DP: tl.constexpr, ROWS: tl.constexpr):
    x, w, at, where, rows = _rows(x_ptr, w_ptr, R, D, DP, ROWS)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps)
    tl.store(y_ptr + at, x * rstd[:, None] * w, mask=where)
    tl.store(rstd_ptr + rows, rstd[:, None], mask=rows < R)


@triton.jit
def _rms_norm_backward(
    x_ptr,
    w_ptr,
    rstd_ptr,
    dy_ptr,
    dr_ptr,
    dx_ptr,
    R,
    HAS_DR: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    ROWS: tl.constexpr,
):
    x, w, at, where, rows = _rows(x_ptr, w_ptr, R, D, DP, ROWS)
    rstd = tl.load(rstd_ptr + rows, mask=rows < R, other=0.0)
    g = tl.load(dy_ptr + at, mask=where, other=0.0) * w
    dx = rstd * g - x * (rstd * rstd * rstd) * (tl.sum(g * x, axis=1)[:, None] / D)
    if HAS_DR:
        dx += tl.load(dr_ptr + at, mask=where, other=0.0)
    tl.store(dx_ptr + at, dx, mask=where)


def _launch(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, dict, tuple]:
    if x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 2:
        raise ValueError(f"contiguous float32 rows [R, d] expected, got {x.dtype} {tuple(x.shape)}")
    if weight.shape != x.shape[1:]:
        raise ValueError(f"a weight [{x.shape[1]}] expected, got {tuple(weight.shape)}")
    rows, width = x.shape
    block = rows_per_program(width)
    constants = dict(D=width, DP=triton.next_power_of_2(max(width, 16)), ROWS=block)
    return rows, constants, (triton.cdiv(rows, block),)


def forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm(x)`` [R, d] with ``weight`` [d], and each row's ``rstd`` [R] for :func:`backward`."""
    rows, constants, grid = _launch(x, weight)
    y, rstd = torch.empty_like(x), x.new_empty(rows)
    if rows:
        with on_device(x.device):
            _rms_norm_forward[grid](x, weight.contiguous(), y, rstd, rows, eps, **constants, num_warps=4)
    return y, rstd


def backward(
    x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, grad_y: torch.Tensor, grad_r: torch.Tensor | None
) -> torch.Tensor:
    """The gradient [R, d] of ``x`` that feeds :func:`forward` (``grad_y`` [R, d] its output's
    gradient) and a residual addition (``grad_r`` [R, d], or None: none)."""
    rows, constants, grid = _launch(x, weight)
    grad_x = torch.empty_like(x)
    if rows:
        grad_y = grad_y.contiguous()
        residual = grad_r is not None
        with on_device(x.device):
            _rms_norm_backward[grid](
                x,
                weight.contiguous(),
                rstd,
                grad_y,
                grad_r.contiguous() if residual else grad_y,  # not read without HAS_DR
                grad_x,
                rows,
                HAS_DR=residual,
                **constants,
                num_warps=4,
            )
    return grad_x
