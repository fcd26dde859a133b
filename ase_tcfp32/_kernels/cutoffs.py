"""PET's adaptive per-atom cutoffs in one kernel (metatrain's ``"solver"`` method).

metatrain finds each atom's cutoff r as the root of ``n(r) = sum_j bump(d_j, r, w) +
N_target (r / r_max)^3 = N_target`` by ten Newton-bisection iterations over every pair,
then attaches gradients with one implicit-function step (``get_adaptive_cutoffs_solver``
in ``metatrain/pet/modules/adaptive_cutoff.py``). Each iteration is ~20 elementwise
kernels and two scatter-adds over all pairs: 37 ms of a 281 ms fp16x3 step of 17,280
water atoms (PET-S shape, 4.4 million pairs within 8.5 Å; measured on H200). Here the
pairs are sorted by center atom (as :func:`ase_tcfp32._neighbors.build_pairs` keeps them), so
one program per atom runs all iterations over its own pairs, which stay in cache: the
same formulas in FP32, summed in another order. The implicit-function step stays in
torch (:func:`adaptive_cutoffs`), so gradients are metatrain's.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .context import on_device
from .segments import segment_sum

ITERATIONS = 10
"""Newton-bisection iterations, as metatrain's solver."""


@triton.jit
def _tanh(x):
    """tanh from one exponential of -2|x| (no overflow)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _counts(distances_ptr, start, end, r, width, slope, CHUNK: tl.constexpr):
    """The atom's smooth neighbor count sum_j bump(d_j, r, w) and its r-derivative."""
    n = tl.zeros((), tl.float32)
    dn = tl.zeros((), tl.float32)
    for k in range(start, end, CHUNK):
        index = k + tl.arange(0, CHUNK)
        d = tl.load(distances_ptr + index, mask=index < end, other=float("inf"))
        scaled = (d - (r - width)) / width
        active = (scaled > 0.0) & (scaled < 1.0)
        s = 3.1415927410125732 * tl.minimum(tl.maximum(scaled, 1e-6), 1.0 - 1e-6)
        sin_s = tl.sin(s)
        tanh_cot = _tanh(tl.cos(s) / sin_s)
        n += tl.sum(tl.where(active, 0.5 * (1.0 + tanh_cot), tl.where(scaled <= 0.0, 1.0, 0.0)))
        dn += tl.sum(tl.where(active, slope * (1.0 - tanh_cot * tanh_cot) / (sin_s * sin_s), 0.0))
    return n, dn


@triton.jit
def _solver_kernel(
    distances_ptr,
    first_ptr,
    r_ptr,
    dn_ptr,
    width,
    slope,
    max_cutoff,
    inv_max_cutoff,
    target,
    ITERATIONS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    atom = tl.program_id(0)
    start = tl.load(first_ptr + atom)
    end = tl.load(first_ptr + atom + 1)
    r_lo = tl.zeros((), tl.float32)
    r_hi = r_lo + max_cutoff
    r = 0.5 * r_hi
    for _ in range(ITERATIONS):
        n, dn = _counts(distances_ptr, start, end, r, width, slope, CHUNK)
        x = r * inv_max_cutoff
        f = (n + target * (x * x * x)) - target
        dn = dn + 3.0 * target * (x * x) * inv_max_cutoff
        below = f <= 0.0
        r_lo = tl.where(below, r, r_lo)
        r_hi = tl.where(below, r_hi, r)
        r_newton = r - f / tl.maximum(dn, 1e-6)
        r = tl.where((r_newton >= r_lo) & (r_newton <= r_hi), r_newton, 0.5 * (r_lo + r_hi))
    _, dn = _counts(distances_ptr, start, end, r, width, slope, CHUNK)
    x = r * inv_max_cutoff
    tl.store(r_ptr + atom, r)
    tl.store(dn_ptr + atom, dn + 3.0 * target * (x * x) * inv_max_cutoff)


def solve(
    distances: torch.Tensor, first: torch.Tensor, target: float, max_cutoff: float, width: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each atom's root r [N] of the smooth neighbor count and dn/dr there [N] (no
    gradients), for the float32 pair ``distances`` [E] sorted by center atom, atom a's
    pairs being ``first[a] .. first[a+1] - 1`` (``first`` [N + 1] int64)."""
    atoms = first.numel() - 1
    r, dn = (torch.empty(atoms, device=distances.device, dtype=torch.float32) for _ in range(2))
    if atoms:
        with on_device(distances.device):
            _solver_kernel[(atoms,)](
                distances,
                first,
                r,
                dn,
                width,
                0.5 * math.pi / width,
                max_cutoff,
                1.0 / max_cutoff,
                target,
                ITERATIONS=ITERATIONS,
                CHUNK=128,
                num_warps=4,
            )
    return r, dn


_solve_op = torch.library.custom_op("ase_tcfp32::adaptive_cutoff_roots", solve, mutates_args=())
""":func:`solve` as a custom op, which ``torch.compile`` calls without looking in. Eager code
calls :func:`solve` itself: an op's first call imports ``torch._dynamo`` (about 0.5 s)."""


@_solve_op.register_fake
def _(distances, first, target, max_cutoff, width):
    atoms = first.shape[0] - 1
    return distances.new_empty(atoms), distances.new_empty(atoms)


def adaptive_cutoffs(
    centers: torch.Tensor,
    distances: torch.Tensor,
    first: torch.Tensor,
    target: float,
    max_cutoff: float,
    width: float,
    bump,
) -> torch.Tensor:
    """metatrain's adaptive cutoffs [N] (Å) of the pairs' center atoms, differentiable
    through ``distances`` [E] (float32, sorted by ``centers`` [E], see :func:`solve`):
    :func:`solve`'s root, then metatrain's implicit-function step with ``bump``
    (its ``cutoff_func_bump``; the counts summed per atom in :func:`.segments.segment_sum`),
    clamped to [max_cutoff / 16, max_cutoff]."""
    roots = _solve_op if torch.compiler.is_compiling() else solve
    r, dn = roots(distances.detach(), first, float(target), float(max_cutoff), float(width))
    counts = segment_sum(bump(distances, r[centers], width), first)
    residual = counts + target * (r / max_cutoff).pow(3) - target
    return (r - residual / dn.clamp_min(1e-6)).clamp(max_cutoff / 16.0, max_cutoff)
