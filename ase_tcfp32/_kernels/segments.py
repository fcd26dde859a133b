"""Sums over sorted segments of rows, deterministic and without atomics (Triton).

The pairs of a neighbor list are sorted by center atom, atom a's being rows ``first[a] ..
first[a + 1] - 1`` of every per-pair tensor, with padding rows after ``first[N]``. Summing a
per-pair quantity per atom (the pairs' gradients onto their atoms, the smooth neighbor
counts of the adaptive cutoffs) is then ``torch.segment_reduce(values, "sum",
offsets=first, axis=0)``, whose generic CUDA kernels are slow for what they move (H200, in
a CUDA graph: 192 water atoms' 7,622 pairs, [E, 3] summed in 5.6 µs against 1.4 µs here,
[E] with its gradient 19.9 against 9.8 µs; 17,280 atoms' 4.75 million pairs 43 against
15 µs and 118 against 38 µs). An ``index_add_`` by center atom would be faster but not
deterministic, and all the padding's atomic additions would queue on atom 0.

Here one program per atom (and block of columns) adds its rows chunk by chunk into a tile,
then sums the tile: in the values' dtype (float32, or float64), in a fixed order, so that
the sums are the same from run to run; they equal ``torch.segment_reduce``'s up to the
order of the additions. The gradient is the gather ``grad_values[e] = grad_sums[a]`` for
each row e of atom a, zero for the rows outside every segment, in the same kind of kernel.
The atom count comes from ``first``'s shape: no host reads, so the kernels can be recorded
in a CUDA graph.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from .context import INTERPRETED, on_device

TILE = 256
"""Elements (rows x columns) a program reads per step of its loop over its atom's rows."""

MAX_BLOCK_COLUMNS = 64
"""Columns per program, at most; wider values get several programs per atom."""


@triton.jit
def _segment(first_ptr, C: tl.constexpr, BLOCK_COLUMNS: tl.constexpr):
    """This program's atom (int64), its rows' range ``[start, end)``, its columns [BLOCK_COLUMNS] and their mask."""
    atom = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
    start = tl.load(first_ptr + atom)
    end = tl.load(first_ptr + atom + 1)
    return atom, start, end, columns, columns < C


@triton.jit
def _sum_kernel(
    values_ptr, first_ptr, sums_ptr, C: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr
):
    atom, start, end, columns, inside = _segment(first_ptr, C, BLOCK_COLUMNS)
    tile = tl.zeros([BLOCK_ROWS, BLOCK_COLUMNS], values_ptr.dtype.element_ty)
    for k in range(start, end, BLOCK_ROWS):
        rows = k + tl.arange(0, BLOCK_ROWS)
        where = (rows < end)[:, None] & inside[None, :]
        tile += tl.load(values_ptr + rows[:, None] * C + columns[None, :], mask=where, other=0.0)
    tl.store(sums_ptr + atom * C + columns, tl.sum(tile, axis=0), mask=inside)


@triton.jit
def _gather_kernel(
    grad_sums_ptr, first_ptr, grad_values_ptr, C: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr
):
    atom, start, end, columns, inside = _segment(first_ptr, C, BLOCK_COLUMNS)
    grad = tl.load(grad_sums_ptr + atom * C + columns, mask=inside, other=0.0)
    tile = tl.zeros([BLOCK_ROWS, BLOCK_COLUMNS], grad.dtype) + grad[None, :]
    for k in range(start, end, BLOCK_ROWS):
        rows = k + tl.arange(0, BLOCK_ROWS)
        where = (rows < end)[:, None] & inside[None, :]
        tl.store(grad_values_ptr + rows[:, None] * C + columns[None, :], tile, mask=where)


def _launch(kernel, source: torch.Tensor, first: torch.Tensor, target: torch.Tensor) -> None:
    """``kernel`` over the N = ``first.shape[0] - 1`` atoms and the columns of the contiguous
    ``source`` and ``target`` (the values [E, ...] and the sums [N, ...], either way; nothing
    to do without rows, atoms or columns)."""
    atoms, columns = first.shape[0] - 1, math.prod(source.shape[1:])
    if source.numel() == 0 or target.numel() == 0:
        return
    block_columns = min(triton.next_power_of_2(columns), MAX_BLOCK_COLUMNS)
    grid = (atoms, triton.cdiv(columns, block_columns))
    with on_device(source.device):
        kernel[grid](source, first, target, columns, max(TILE // block_columns, 2), block_columns, num_warps=2)


def sum_rows(values: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """The sums [N, ...] of the rows of ``values`` [E, ...] (float32 or float64, on CUDA or
    under Triton's interpreter) over each segment: rows ``first[a] .. first[a + 1] - 1`` for
    atom a (``first`` [N + 1] int64, non-decreasing; the rows outside, like the padding
    after ``first[N]``, left out); zero for an empty segment. No gradient."""
    values = values.contiguous()
    shape = (first.shape[0] - 1, *values.shape[1:])
    sums = values.new_empty(shape) if values.shape[0] else values.new_zeros(shape)  # each program writes its atom's
    _launch(_sum_kernel, values, first, sums)
    return sums


def gather_rows(grad_sums: torch.Tensor, first: torch.Tensor, rows: int) -> torch.Tensor:
    """The gradient [``rows``, ...] of :func:`sum_rows`'s values for its sums' gradient
    ``grad_sums`` [N, ...]: row e of atom a's segment gets ``grad_sums[a]``, the rows outside
    every segment zero. No gradient."""
    grad_sums = grad_sums.contiguous()
    grad_values = grad_sums.new_zeros(rows, *grad_sums.shape[1:])
    _launch(_gather_kernel, grad_sums, first, grad_values)
    return grad_values


class _SegmentSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, first):
        ctx.save_for_backward(first)
        ctx.rows = values.shape[0]
        return sum_rows(values, first)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_sums):
        (first,) = ctx.saved_tensors
        return gather_rows(grad_sums, first, ctx.rows), None


def on_kernel(values: torch.Tensor) -> bool:
    """Whether :func:`segment_sum` takes ``values`` into the kernels: float32 or float64, on
    CUDA (or on CPU under Triton's interpreter), outside ``torch.compile`` (which keeps
    ``torch.segment_reduce``)."""
    return (
        values.dtype in (torch.float32, torch.float64)
        and values.dim() >= 1
        and not torch.compiler.is_compiling()
        and (values.is_cuda or INTERPRETED)
    )


def segment_sum(values: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``torch.segment_reduce(values, "sum", offsets=first, axis=0)``: the sums [N, ...] of
    the rows of ``values`` [E, ...] over the sorted segments ``first[a] .. first[a + 1] - 1``
    (``first`` [N + 1] int64; the rows at or after ``first[N]`` left out), differentiable
    (backward: :func:`gather_rows`, once). In the kernels where :func:`on_kernel`, so equal to
    torch's up to the order of the additions (FP32 or FP64 rounding), the same from run to
    run; elsewhere torch's own."""
    if not on_kernel(values):
        return torch.segment_reduce(values, "sum", offsets=first, axis=0)
    return _SegmentSum.apply(values, first)
