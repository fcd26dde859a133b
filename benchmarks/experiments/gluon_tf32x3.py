"""TF32x3 GEMM for Hopper written in Gluon (Triton's explicit-layout dialect): EXPERIMENTAL.

No precision runs this kernel (tf32x3 runs the Triton kernel, fp16x3 its own Gluon kernel);
only ``gluon_variants.py`` and ``compile_sm90.py`` in this folder use it.

Same arithmetic as :mod:`ase_tcfp32._kernels.triton_gemm` (per K-tile: hi*B_hi in a fresh
tensor-core accumulator joining the FP32 sum with one IEEE addition; lo*B_hi and hi_c*B_lo
in a corrections accumulator over all of K, added at the end), scheduled by hand: the three
products of a K-tile are issued back to back as asynchronous wgmma groups, and one wait
that leaves the last correction group in flight lets the hi*hi tile join the sum while it
runs; x, W_hi and W_lo come through a ``STAGES``-deep TMA ring, and the output leaves
through a TMA store (out-of-range rows and columns are clipped by TMA, as loads are
zero-filled). A warp-specialised variant has a producer warp issue the loads.

Measured on H200 (``benchmarks/experiments/gluon_variants.py``, four runs): the warp-specialised
variant at 4 stages 1.55-1.88x cuBLAS FP32 on the 17,280-atom PET-S shapes, the Triton
kernel 1.44-1.80x in the same runs (about 3% apart on average, at the same error), so the
Triton kernel stays the tf32x3 default. Compiled offline, ptxas serialises this kernel's
wgmma (a full wait after each one) like the Triton kernel's (``docs/design.md``).
Its building blocks shared with the fp16x3 kernel are in ``ase_tcfp32/_kernels/gluon_common.py``.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ase_tcfp32._kernels.context import on_device
from ase_tcfp32._kernels.gluon_common import copy_stage, descriptor, load_stage, ring, tile_offsets, tma_ready
from ase_tcfp32._kernels.triton_gemm import Gemm, TritonBackend, _split_tf32, tile_config


@gluon.jit
def _k_tile(x_s, hi_s, lo_s, acc, small, hic_prev, a_layout: gl.constexpr):
    """One K-tile: hi*B_hi, lo*B_hi, hi_c*B_lo issued as three asynchronous wgmma groups;
    the wait leaves the last one in flight (its A word ``hi_c`` is kept alive until the
    next K-tile's wait) while the hi*hi tile joins the FP32 sum."""
    hi, lo, hi_c = _split_tf32(x_s.load(a_layout))
    b_hi = hi_s.permute((1, 0))
    tile = warpgroup_mma(hi, b_hi, gl.zeros_like(acc), use_acc=False, is_async=True)
    small = warpgroup_mma(lo, b_hi, small, is_async=True)
    small = warpgroup_mma(hi_c, lo_s.permute((1, 0)), small, is_async=True)
    tile, small, hic_prev, _ = warpgroup_mma_wait(num_outstanding=1, deps=(tile, small, hi_c, hic_prev))
    return acc + tile, small, hic_prev


@gluon.jit
def _epilogue(acc, bias_ptr, N, off_m, off_n, y_desc, HAS_BIAS: gl.constexpr):
    """``acc (+ bias)`` to the output tile through shared memory and a TMA store."""
    if HAS_BIAS:
        cols = off_n + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, acc.type.layout))
        acc = acc + gl.expand_dims(gl.load(bias_ptr + cols, mask=cols < N, other=0.0), 0)
    ys = gl.allocate_shared_memory(gl.float32, acc.shape, y_desc.layout)
    ys.store(acc)
    fence_async_shared()
    tma.async_copy_shared_to_global(y_desc, [off_m, off_n], ys)
    tma.store_wait(pendings=0)


@gluon.jit
def _tf32x3_kernel(
    x_desc,
    hi_desc,
    lo_desc,
    y_desc,
    bias_ptr,
    M,
    N,
    HAS_BIAS: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    num_warps: gl.constexpr,
):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = hi_desc.block_type.shape[0]
    off_m, off_n = tile_offsets(M, N, BM, BN, GROUP_M)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=1)
    xs = gl.allocate_shared_memory(gl.float32, [STAGES, BM, BK], x_desc.layout)
    his = gl.allocate_shared_memory(gl.float32, [STAGES, BN, BK], hi_desc.layout)
    los = gl.allocate_shared_memory(gl.float32, [STAGES, BN, BK], lo_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    num_k = gl.cdiv(x_desc.shape[1], BK)
    for i in gl.static_range(STAGES - 1):
        if i < num_k:
            copy_stage(
                x_desc, hi_desc, lo_desc, xs.index(i), his.index(i), los.index(i), ready.index(i), off_m, off_n, i * BK
            )

    acc = gl.zeros((BM, BN), gl.float32, mma)  # FP32 running sum of the hi*hi tiles
    small = gl.zeros((BM, BN), gl.float32, mma)  # tensor-core sum of the corrections
    hic_prev = gl.zeros((BM, BK), gl.float32, a_layout)  # A word of the product in flight
    for ki in range(num_k):
        s = ki % STAGES
        mbarrier.wait(ready.index(s), (ki // STAGES) & 1)
        acc, small, hic_prev = _k_tile(xs.index(s), his.index(s), los.index(s), acc, small, hic_prev, a_layout)
        # K-tile ki - 1 is done in this warpgroup; the copies below wait at a CTA barrier
        # (Gluon puts one before each TMA issue), so the other warpgroup is done with it too
        nk = ki + STAGES - 1
        if nk < num_k:
            ns = nk % STAGES
            copy_stage(
                x_desc,
                hi_desc,
                lo_desc,
                xs.index(ns),
                his.index(ns),
                los.index(ns),
                ready.index(ns),
                off_m,
                off_n,
                nk * BK,
            )
    small = warpgroup_mma_wait(num_outstanding=0, deps=(small,))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    _epilogue(acc + small, bias_ptr, N, off_m, off_n, y_desc, HAS_BIAS)


@gluon.jit
def _loader(x_desc, hi_desc, lo_desc, xs, his, los, ready, empty, off_m, off_n, STAGES: gl.constexpr):
    """Producer warp: TMA loads into the ring, each stage once the consumers freed it."""
    BK: gl.constexpr = x_desc.block_type.shape[1]
    for ki in range(gl.cdiv(x_desc.shape[1], BK)):
        load_stage(x_desc, hi_desc, lo_desc, xs, his, los, ready, empty, ki, off_m, off_n, ki * BK, STAGES)


@gluon.jit
def _consumer(xs, his, los, ready, empty, num_k, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """Two consumer warpgroups: the K loop of :func:`_k_tile`, freeing each stage after use."""
    BM: gl.constexpr = xs.shape[1]
    BK: gl.constexpr = xs.shape[2]
    BN: gl.constexpr = his.shape[1]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=1)
    acc = gl.zeros((BM, BN), gl.float32, mma)
    small = gl.zeros((BM, BN), gl.float32, mma)
    hic_prev = gl.zeros((BM, BK), gl.float32, a_layout)
    for ki in range(num_k):
        s = ki % STAGES
        mbarrier.wait(ready.index(s), (ki // STAGES) & 1)
        acc, small, hic_prev = _k_tile(xs.index(s), his.index(s), los.index(s), acc, small, hic_prev, a_layout)
        # K-tile ki - 1 is complete (the wait above); one arrival after a consumer barrier
        mbarrier.arrive(empty.index((ki + STAGES - 1) % STAGES), count=1, pred=ki > 0)
    small = warpgroup_mma_wait(num_outstanding=0, deps=(small,))
    return (acc + small,)


@gluon.jit
def _tf32x3_ws_kernel(
    x_desc,
    hi_desc,
    lo_desc,
    y_desc,
    bias_ptr,
    M,
    N,
    HAS_BIAS: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    num_warps: gl.constexpr,
):
    """:func:`_tf32x3_kernel` with warp specialisation: a producer warp issues the TMA loads
    (no CTA barriers in the consumers' loop), the consumers wait on per-stage barriers."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = hi_desc.block_type.shape[0]
    off_m, off_n = tile_offsets(M, N, BM, BN, GROUP_M)
    xs, his, los, ready, empty = ring(x_desc, hi_desc, lo_desc, STAGES)
    num_k = gl.cdiv(x_desc.shape[1], BK)
    (acc,) = gl.warp_specialize(
        [
            (_consumer, (xs, his, los, ready, empty, num_k, STAGES, num_warps)),
            (_loader, (x_desc, hi_desc, lo_desc, xs, his, los, ready, empty, off_m, off_n, STAGES)),
        ],
        [1],
        [24],
    )
    _epilogue(acc, bias_ptr, N, off_m, off_n, y_desc, HAS_BIAS)


CONFIG = dict(BM=128, BN=128, BK=32, STAGES=4, GROUP_M=8, num_warps=8, WS=True)
"""Tile shape, pipeline depth (4 stages: 192 KiB of shared memory), warp specialisation:
the fastest measured variant (1.6-1.9x cuBLAS FP32; the Triton kernel: 1.4-1.8x)."""


def launch(x: torch.Tensor, gemm: Gemm, bias: torch.Tensor | None = None, config: dict = CONFIG) -> torch.Tensor:
    """``x [M, K] @ w^T (+ bias)`` as [M, N] with the tf32x3 words of ``gemm`` ([2, N, KP])."""
    m, k = x.shape
    _, n, kp = gemm.words.shape
    np_ = triton.cdiv(n, 4) * 4  # 16-byte rows for the TMA store
    y = torch.empty((m, np_), device=x.device, dtype=torch.float32)
    if m == 0 or k == 0:
        y = y[:, :n]
        return y.zero_() if bias is None or m == 0 else y.copy_(bias.expand(m, n))
    bm, bn, bk = config["BM"], config["BN"], config["BK"]
    x_desc = descriptor(tma_ready(x, kp), [bm, bk])
    hi_desc = descriptor(gemm.words[0], [bn, bk])
    lo_desc = descriptor(gemm.words[1], [bn, bk])
    y_desc = descriptor(y, [bm, bn])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    kernel = _tf32x3_ws_kernel if config["WS"] else _tf32x3_kernel
    with on_device(x.device):
        kernel[grid](
            x_desc,
            hi_desc,
            lo_desc,
            y_desc,
            bias if bias is not None else y,
            m,
            n,
            HAS_BIAS=bias is not None,
            STAGES=config["STAGES"],
            GROUP_M=config["GROUP_M"],
            num_warps=config["num_warps"],
        )
    return y[:, :n]


class GluonBackend(TritonBackend):
    """tf32x3 through :func:`launch` on Hopper (sm_90), with :class:`TritonBackend`'s
    weight words and small-GEMM rule (below :func:`triton_gemm.min_rows`: the Triton kernel's
    small tiles, or cuBLAS FP32)."""

    name = "gluon"
    launch = staticmethod(launch)

    def __init__(self, precision: str = "tf32x3"):
        if precision != "tf32x3":
            raise ValueError(f"the Gluon kernel computes tf32x3 only, not {precision!r}")
        super().__init__(precision)

    def _tuned(self, w: torch.Tensor, finite: bool) -> dict:
        return tile_config(*w.shape)  # nothing to tune: launch() takes its own CONFIG
