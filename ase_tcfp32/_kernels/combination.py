"""PET's message combination between GNN layers in one pass each way (Triton).

After each GNN layer, metatrain's feed-forward featurizer gives every neighbor slot p the
message of its reverse slot r(p) (the pair j -> i of the pair i -> j) and normalises both
side by side: ``y = LayerNorm(cat(o, o[r]))`` for the layer's edge outputs ``o`` [P, D]
(P = atoms x neighbor slots). Eagerly that is a gather, a ``cat`` and the norm forward,
and the norm's backward, the ``cat``'s split and an ``index_add`` backward: passes over
P x 2D floats each (1.4 GB per tensor with PET-S at 17,280 water atoms). Here the
forward reads ``o`` twice (its rows and their reverses) and writes ``y`` with each row's
mean and reciprocal standard deviation; the backward reads ``o`` and ``dy`` once each
and writes ``do``. With the layer's input edges ``e`` [P, D], the forward pass also
writes ``e + o`` (the combination's residual, an addition of its own eagerly: it reads the
rows of ``o`` it has loaded anyway) and the backward pass adds that sum's gradient into
``do`` (eagerly another addition, autograd's sum of ``o``'s two uses).

The backward needs ``r`` to be an involution (``r[r[p]] == p`` for every slot, padding
included: PET's reverse pairs are symmetric, and a padding slot is its own reverse, see
:func:`ase_tcfp32._fused.combine_messages`). Then the gradient of ``o[p]`` is the first
half of ``dx`` of row p plus the second half of ``dx`` of row r(p), both computed by the
program of the orbit's first slot, with no atomic additions.

Arithmetic in FP32 as a LayerNorm is defined, with two-pass moments: ``mean = sum(x) /
2D``, ``var = sum((x - mean)^2) / 2D`` (biased), ``rstd = 1 / sqrt(var + eps)`` (both
correctly rounded), ``y = (x - mean) * rstd * w + b``; backward ``dx = rstd * (g -
mean(g) - xhat * mean(g * xhat))`` with ``g = dy * w`` and ``xhat = (x - mean) * rstd``.
The weight and bias get no gradient (the calculator's model is frozen).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .context import on_device


def rows_per_program(width: int, backward: bool) -> int:
    """Rows of ``o`` [P, ``width``] per program. Measured on the H200 at 17,280 atoms
    (``benchmarks/fused.py``, ``benchmarks/results/fused_h200.json``; forward / forward + backward
    ms with 2, 4, 8 rows): PET-S (D = 256) 0.707 / 2.257, 0.664 / 1.881, 0.674 / 1.914;
    PET-M (D = 384, padded to 512 lanes) 1.315 / 4.067, 1.297 / 4.685, 1.323 / 4.972. So 4
    forward, and backward (six rows' worth of values live per row) 1,024 lanes' worth."""
    return 4 if not backward else max(1, 1024 // triton.next_power_of_2(max(width, 16)))


@triton.jit
def _halves(o_ptr, rows_a, rows_b, inside, D: tl.constexpr, DP: tl.constexpr):
    """Rows ``rows_a`` and ``rows_b`` [ROWS, 1] of ``o`` [P, D] as [ROWS, DP] (zero past D)."""
    c = tl.arange(0, DP)[None, :]
    where = inside & (c < D)
    a = tl.load(o_ptr + rows_a * D + c, mask=where, other=0.0)
    b = tl.load(o_ptr + rows_b * D + c, mask=where, other=0.0)
    return a, b, c, where


@triton.jit
def _halves_of(vector_ptr, c, D: tl.constexpr):
    """The first and second halves of a [2D] vector (the norm's weight or bias) at columns ``c``."""
    return tl.load(vector_ptr + c, mask=c < D), tl.load(vector_ptr + D + c, mask=c < D)


@triton.jit
def _standardised(a, b, mean, rstd, where):
    """``(x - mean) * rstd`` of the row ``x = [a, b]``, zero past D."""
    return tl.where(where, (a - mean) * rstd, 0.0), tl.where(where, (b - mean) * rstd, 0.0)


@triton.jit
def _combination_forward(
    o_ptr,
    reverse_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    e_ptr,
    s_ptr,
    P,
    eps,
    D: tl.constexpr,
    DP: tl.constexpr,
    ROWS: tl.constexpr,
    RESIDUAL: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    real = p < P
    r = tl.load(reverse_ptr + p, mask=real, other=0)
    a, b, c, where = _halves(o_ptr, p[:, None], r[:, None], real[:, None], D, DP)
    if RESIDUAL:  # e + o, from the rows of o in registers
        at = p[:, None] * D + c
        tl.store(s_ptr + at, tl.load(e_ptr + at, mask=where, other=0.0) + a, mask=where)
    mean = (tl.sum(a, 1) + tl.sum(b, 1)) / (2 * D)
    xa, xb = tl.where(where, a - mean[:, None], 0.0), tl.where(where, b - mean[:, None], 0.0)
    var = (tl.sum(xa * xa, 1) + tl.sum(xb * xb, 1)) / (2 * D)
    rstd = 1.0 / tl.sqrt_rn(var + eps)
    wa, wb = _halves_of(w_ptr, c, D)
    ba, bb = _halves_of(b_ptr, c, D)
    out = y_ptr + p[:, None] * (2 * D) + c
    tl.store(out, xa * rstd[:, None] * wa + ba, mask=where)
    tl.store(out + D, xb * rstd[:, None] * wb + bb, mask=where)
    tl.store(mean_ptr + p, mean, mask=real)
    tl.store(rstd_ptr + p, rstd, mask=real)


@triton.jit
def _row_gradient(a, b, dy_ptr, row, mean, rstd, wa, wb, c, where, D: tl.constexpr):
    """The LayerNorm gradient [ROWS, DP] x 2 of the rows ``x = [a, b]`` (``row`` [ROWS, 1]
    into ``dy`` [P, 2D], their ``mean`` and ``rstd`` [ROWS, 1])."""
    ga = tl.load(dy_ptr + row * (2 * D) + c, mask=where, other=0.0) * wa
    gb = tl.load(dy_ptr + row * (2 * D) + D + c, mask=where, other=0.0) * wb
    xa, xb = _standardised(a, b, mean, rstd, where)
    c1 = (tl.sum(ga, 1) + tl.sum(gb, 1))[:, None] / (2 * D)
    c2 = (tl.sum(ga * xa, 1) + tl.sum(gb * xb, 1))[:, None] / (2 * D)
    return rstd * (ga - c1 - xa * c2), rstd * (gb - c1 - xb * c2)


@triton.jit
def _combination_backward(
    o_ptr,
    reverse_ptr,
    w_ptr,
    dy_ptr,
    mean_ptr,
    rstd_ptr,
    do_ptr,
    ds_ptr,
    P,
    D: tl.constexpr,
    DP: tl.constexpr,
    ROWS: tl.constexpr,
    RESIDUAL: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    r = tl.load(reverse_ptr + p, mask=p < P, other=0)
    lead = (p < P) & (p <= r)  # the orbit {p, r(p)} is this program's
    a, b, c, where = _halves(o_ptr, p[:, None], r[:, None], lead[:, None], D, DP)
    wa, wb = _halves_of(w_ptr, c, D)
    stats_p = tl.load(mean_ptr + p, mask=lead, other=0.0)[:, None], tl.load(rstd_ptr + p, mask=lead, other=0.0)[:, None]
    stats_r = tl.load(mean_ptr + r, mask=lead, other=0.0)[:, None], tl.load(rstd_ptr + r, mask=lead, other=0.0)[:, None]
    pa, pb = _row_gradient(a, b, dy_ptr, p[:, None], *stats_p, wa, wb, c, where, D)  # row p = [o_p, o_r]
    ra, rb = _row_gradient(b, a, dy_ptr, r[:, None], *stats_r, wa, wb, c, where, D)  # row r = [o_r, o_p]
    at_p, at_r = p[:, None] * D + c, r[:, None] * D + c
    if RESIDUAL:  # the gradient of e + o joins o's
        pa += tl.load(ds_ptr + at_p, mask=where, other=0.0)
        ra += tl.load(ds_ptr + at_r, mask=where, other=0.0)
    tl.store(do_ptr + at_p, pa + rb, mask=where)
    tl.store(do_ptr + at_r, ra + pb, mask=where)  # p == r (padding): the same sum again


def _launch(o: torch.Tensor, reverse: torch.Tensor, backward: bool) -> tuple:
    """``(P, D, constants, grid)`` for ``o`` [..., D] float32 and ``reverse`` [...] int64,
    contiguous (checked first)."""
    if o.dtype != torch.float32 or not o.is_contiguous() or reverse.dtype != torch.int64 or not reverse.is_contiguous():
        raise ValueError(
            f"contiguous float32 messages and int64 reverse slots expected, got {o.dtype} and {reverse.dtype}"
        )
    if reverse.shape != o.shape[:-1]:
        raise ValueError(f"one reverse slot per message expected: {tuple(reverse.shape)} for {tuple(o.shape)}")
    rows, width = reverse.numel(), o.shape[-1]
    block = rows_per_program(width, backward)
    constants = dict(D=width, DP=triton.next_power_of_2(max(width, 16)), ROWS=block)
    return rows, width, constants, (triton.cdiv(rows, block),)


def forward(
    o: torch.Tensor,
    reverse: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple:
    """``LayerNorm(cat(o, o[reverse]))`` [..., 2D] for ``o`` [..., D] and the slots
    ``reverse`` [...] (indices into ``o``'s rows, flattened), with ``weight`` and ``bias``
    [2D]; each row's mean and reciprocal standard deviation [P] for :func:`backward`; with
    ``residual`` [..., D] (contiguous float32), ``residual + o`` too."""
    rows, width, constants, grid = _launch(o, reverse, backward=False)
    if residual is not None and (
        residual.shape != o.shape or residual.dtype != o.dtype or not residual.is_contiguous()
    ):
        raise ValueError(f"a contiguous float32 residual shaped as the messages expected, got {tuple(residual.shape)}")
    y = o.new_empty(*o.shape[:-1], 2 * width)
    mean, rstd = o.new_empty(rows), o.new_empty(rows)
    summed = None if residual is None else torch.empty_like(o)
    if rows:
        with on_device(o.device):
            _combination_forward[grid](
                o,
                reverse,
                weight.contiguous(),
                bias.contiguous(),
                y,
                mean,
                rstd,
                o if residual is None else residual,
                o if summed is None else summed,
                rows,
                eps,
                **constants,
                RESIDUAL=residual is not None,
                num_warps=4,
            )
    return y, mean, rstd, summed


def backward(
    grad_y: torch.Tensor,
    o: torch.Tensor,
    reverse: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    grad_summed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient [..., D] of :func:`forward` with respect to ``o``, for ``grad_y`` [...,
    2D] (and the gradient ``grad_summed`` [..., D] of its ``residual + o``, added);
    ``reverse`` must be an involution (see the module doc)."""
    rows, width, constants, grid = _launch(o, reverse, backward=True)
    grad_o = torch.empty_like(o)
    if rows:
        with on_device(o.device):
            _combination_backward[grid](
                o,
                reverse,
                weight.contiguous(),
                grad_y.contiguous(),
                mean,
                rstd,
                grad_o,
                grad_o if grad_summed is None else grad_summed.contiguous(),
                rows,
                **constants,
                RESIDUAL=grad_summed is not None,
                num_warps=8,
            )
    return grad_o
