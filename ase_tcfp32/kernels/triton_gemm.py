"""Triton GEMM kernels for tf32, tf32x3 and bf16x9 on Ampere and newer GPUs.

``y[M, N] = x[M, K] @ w[N, K]^T (+ bias)`` with ``w`` pre-split into tensor-core words
and stored K-major (``nn.Linear`` layout, as TF32 wgmma wants); ``x`` is split in
registers with the same bit rules as :mod:`ase_tcfp32.kernels.split`. In each K-tile
the small products go into a fresh accumulator, NaN corrections are dropped, hi*hi is
added on top and the tile result joins the FP32 running sum (see ``reference.py``).
The dX backward is the same kernel with the pre-split ``w^T``.

Offsets are int64 (M up to ~1e7 rows), M is not specialised on (no recompilation as
the number of atoms changes), and the tile shape is chosen from (N, K). GEMMs too small
to fill the GPU go to cuBLAS FP32 in the FP32-accurate modes (:func:`min_rows`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .split import round_tf32, split_bf16x3


@triton.jit
def _round_tf32(x):
    """RNA to TF32 by bits (measured faster than inline ``cvt.rna`` on H200); a finite
    x that would round to Inf is truncated instead."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x1000) & -8192).to(tl.float32, bitcast=True)
    truncated = (bits & -8192).to(tl.float32, bitcast=True)
    overflow = (tl.abs(rounded) == float("inf")) & (tl.abs(x) != float("inf"))
    rounded = tl.where(overflow, truncated, rounded)
    return tl.where(x != x, x, rounded)


@triton.jit
def _round_bf16(x):
    """RNE to BF16; a finite x that would round to Inf is truncated instead."""
    rounded = x.to(tl.bfloat16)
    truncated = (x.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True).to(tl.bfloat16)
    overflow = (tl.abs(rounded.to(tl.float32)) == float("inf")) & (tl.abs(x) != float("inf"))
    return tl.where(overflow, truncated, rounded)


@triton.jit
def _tile_offsets(M, N, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """Row, column (int64) and K offsets of this program's output tile.

    Grouped tile order: GROUP_M row-tiles in a row share the W tiles in L2."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    return rm, rn, tl.arange(0, BK)


@triton.jit
def _store_tile(y_ptr, acc, bias_ptr, rm, rn, M, N, stride_ym, HAS_BIAS: tl.constexpr):
    """Epilogue: add the bias in FP32 and store the tile."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _tf32_linear_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
    PASSES: tl.constexpr, HAS_BIAS: tl.constexpr, FINITE_W: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    rm, rn, rk = _tile_offsets(M, N, BM, BN, BK, GROUP_M)
    x_rows = x_ptr + rm[:, None] * stride_xm
    w_cols = w_ptr + rn[None, :] * K  # w words: [PASSES > 1 ? 2 : 1, N, K]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(x_rows + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w_mask = (kk[:, None] < K) & (rn[None, :] < N)
        b_hi = tl.load(w_cols + kk[:, None], mask=w_mask, other=0.0)
        a_hi = _round_tf32(a)
        if PASSES == 3:
            b_lo = tl.load(w_cols + N * K + kk[:, None], mask=w_mask, other=0.0)
            if FINITE_W:  # zero the corrections of Inf/NaN inputs: no NaN mask on the tile
                finite = tl.abs(a) < float("inf")
                small = tl.dot(tl.where(finite, a - a_hi, 0.0), b_hi, input_precision="tf32")
                small = tl.dot(tl.where(finite, a_hi, 0.0), b_lo, small, input_precision="tf32")
            else:
                small = tl.dot(a - a_hi, b_hi, input_precision="tf32")
                small = tl.dot(a_hi, b_lo, small, input_precision="tf32")
                small = tl.where(small == small, small, 0.0)
            acc += tl.dot(a_hi, b_hi, small, input_precision="tf32")
        else:
            acc = tl.dot(a_hi, b_hi, acc, input_precision="tf32")
    _store_tile(y_ptr, acc, bias_ptr, rm, rn, M, N, stride_ym, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def _bf16x9_linear_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
    HAS_BIAS: tl.constexpr, FINITE_W: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    rm, rn, rk = _tile_offsets(M, N, BM, BN, BK, GROUP_M)
    x_rows = x_ptr + rm[:, None] * stride_xm
    w_cols = w_ptr + rn[None, :] * K  # bf16 words: [3, N, K]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(x_rows + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w_mask = (kk[:, None] < K) & (rn[None, :] < N)
        b0 = tl.load(w_cols + kk[:, None], mask=w_mask, other=0.0)
        b1 = tl.load(w_cols + N * K + kk[:, None], mask=w_mask, other=0.0)
        b2 = tl.load(w_cols + 2 * N * K + kk[:, None], mask=w_mask, other=0.0)
        a0 = _round_bf16(a)
        rest = a - a0.to(tl.float32)
        a1 = _round_bf16(rest)
        a2 = _round_bf16(rest - a1.to(tl.float32))
        a0_small = a0
        if FINITE_W:  # zero the corrections of Inf/NaN inputs: no NaN mask on the tile
            finite = tl.abs(a) < float("inf")
            a0_small = tl.where(finite, a0, 0.0).to(tl.bfloat16)
            a1 = tl.where(finite, a1, 0.0).to(tl.bfloat16)
            a2 = tl.where(finite, a2, 0.0).to(tl.bfloat16)
        small = tl.dot(a2, b2)  # smallest products first, as in reference.SCHEMES
        small = tl.dot(a2, b1, small)
        small = tl.dot(a1, b2, small)
        small = tl.dot(a2, b0, small)
        small = tl.dot(a1, b1, small)
        small = tl.dot(a0_small, b2, small)
        small = tl.dot(a1, b0, small)
        small = tl.dot(a0_small, b1, small)
        if not FINITE_W:
            small = tl.where(small == small, small, 0.0)
        acc += tl.dot(a0, b0, small)
    _store_tile(y_ptr, acc, bias_ptr, rm, rn, M, N, stride_ym, HAS_BIAS)


def tile_config(n: int, k: int) -> dict:
    """Tile shape and launch parameters for an output width ``n`` and depth ``k``."""
    bn = min(128, max(16, triton.next_power_of_2(n)))
    bk = 32 if k >= 32 else 16
    return dict(BM=128, BN=bn, BK=bk, GROUP_M=8, num_warps=8 if bn >= 128 else 4, num_stages=3)


class Gemm(NamedTuple):
    """One direction of a split weight: words [words, N, K], launch config, dispatch."""

    words: torch.Tensor
    config: dict
    tiles_n: int
    min_rows: int  # fewer rows than this go to cuBLAS FP32 (see min_rows)


class Prepared(NamedTuple):
    """A weight [N, K] split once, for y = x w^T (forward) and dx = dy w (backward)."""

    weight: torch.Tensor
    forward: Gemm
    backward: Gemm
    finite: bool


def min_rows(n: int, k: int, device: torch.device) -> int:
    """Rows from which an [M, n] output fills at least half of the GPU's SMs with tiles.

    Below that (PET's node layers at a few hundred atoms: 16-48 tiles of 128 x 128 on
    132 SMs) the three-pass kernel measured 0.2-0.8x cuBLAS FP32 on H200, so the
    FP32-accurate precisions use cuBLAS FP32 there; at 64+ tiles it measured >= 1.1x.
    """
    if device.type != "cuda":
        return 0
    config = tile_config(n, k)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles_n = triton.cdiv(n, config["BN"])
    return (triton.cdiv(sms, 2 * tiles_n) - 1) * config["BM"] + 1


def _launch(x: torch.Tensor, gemm: Gemm, finite: bool, bias: torch.Tensor | None, precision: str) -> torch.Tensor:
    m, k = x.shape
    n = gemm.words.shape[1]
    y = torch.empty((m, n), device=x.device, dtype=torch.float32)
    if m == 0:
        return y
    if k == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(m, n))
    grid = (triton.cdiv(m, gemm.config["BM"]) * gemm.tiles_n,)
    bias_arg = bias if bias is not None else y
    common = (x, gemm.words, bias_arg, y, m, n, k, x.stride(0), y.stride(0))
    if precision == "bf16x9":
        _bf16x9_linear_kernel[grid](*common, HAS_BIAS=bias is not None, FINITE_W=finite, **gemm.config)
    else:
        passes = 3 if precision == "tf32x3" else 1
        _tf32_linear_kernel[grid](*common, PASSES=passes, HAS_BIAS=bias is not None, FINITE_W=finite, **gemm.config)
    return y


class TritonBackend:
    """Our Triton kernels, with the layer interface of every backend.

    In tf32x3 and bf16x9, GEMMs too small to fill the GPU run cuBLAS FP32 instead
    (:func:`min_rows`); single-pass tf32 always runs its kernel.
    """

    name = "triton"

    def __init__(self, precision: str):
        self.precision = precision

    def _words(self, w: torch.Tensor) -> torch.Tensor:
        if self.precision == "tf32":
            return round_tf32(w).unsqueeze(0)
        if self.precision == "tf32x3":
            hi = round_tf32(w)
            return torch.stack([hi, w - hi])
        return torch.stack(split_bf16x3(w)).to(torch.bfloat16)  # exact: the words are BF16

    def _gemm(self, w: torch.Tensor) -> Gemm:
        n, k = w.shape
        config = tile_config(n, k)
        rows = 0 if self.precision == "tf32" else min_rows(n, k, w.device)
        return Gemm(self._words(w), config, triton.cdiv(n, config["BN"]), rows)

    def prepare(self, weight: torch.Tensor) -> Prepared:
        """Words of ``weight`` [N, K] and of its transpose, each [words, rows, K]."""
        weight = weight.detach().float().contiguous()
        finite = bool(torch.isfinite(weight).all())
        return Prepared(weight, self._gemm(weight), self._gemm(weight.T.contiguous()), finite)

    def forward(self, x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] < prepared.forward.min_rows:
            return torch.nn.functional.linear(x, prepared.weight, bias)
        bias = None if bias is None else bias.detach().contiguous()
        return _launch(x, prepared.forward, prepared.finite, bias, self.precision)

    def grad_input(self, grad_y: torch.Tensor, prepared: Prepared) -> torch.Tensor:
        if grad_y.shape[0] < prepared.backward.min_rows:
            return grad_y @ prepared.weight
        return _launch(grad_y, prepared.backward, prepared.finite, None, self.precision)
