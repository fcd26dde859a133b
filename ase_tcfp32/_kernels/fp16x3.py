"""fp16x3 GEMM for Hopper (sm_90) in Gluon: FP32-accurate products on FP16 tensor cores.

``y[M, N] = x[M, K] @ w[N, K]^T (+ bias)``, each FP32 operand written as ``2^-a (hi + lo)``
with FP16 words ``hi``, ``lo`` and one power of two ``2^a`` per row (of ``w`` once, of
``x`` per K-tile) that puts the row's maximum at the top of FP16's range
(:func:`ase_tcfp32._kernels.split.scale_rows`). Per K-tile, ``lo*w_hi + hi*w_lo +
hi*w_hi`` (lo*lo dropped) go into a fresh tensor-core accumulator, which joins the FP32
sum with one multiply-add by the rows' ``2^-a``; the weight's scale is undone at the end.
FP16 tensor cores run twice as fast as TF32 ones, so the three products cost what 1.5
TF32 passes would; the per-row scaling keeps FP32's exponent range.

Measured on H200 (``benchmarks/gemm.py``, ``docs/performance.md``): 2.50-3.48x cuBLAS FP32
on the 17,280-atom PET-S layers and 2.56-3.58x on PET-M, forward and backward, at 0.2-0.4x
its error vs FP64; the Triton tf32x3 kernel 1.6-2.3x in the same run. The kernel is
persistent and warp specialised: a TMA producer warp streams x (FP32) and the weight's
words through a ring; two consumer warpgroups split K-tile k in registers, add the
products of k - 1 to the FP32 sum with no wgmma in flight (the one schedule ptxas does
not serialise) and issue k; each finished output tile leaves through shared memory and a
TMA store that runs during the next tile (``docs/design.md``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

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

from . import autotune, narrow
from .context import on_device
from .epilogue import ACTIVATIONS, Embedding, gl_embedding, gl_silu, gl_swiglu, without_product
from .gluon_common import descriptor, load_stage, ring, tile_offsets, tma_ready
from .split import split_fp16x3
from .triton_gemm import NEVER, SMALL_ROWS, check_parts, min_rows, parts, plain, sm_count, small


@gluon.jit
def _pow2_scales(amax):
    """``(2^a, 2^-a)`` per row that bring the row maximum ``amax`` into [2^14, 2^15), the
    top of FP16's range (``a`` clamped to [-126, 126]: zero rows, subnormals, Inf/NaN)."""
    exponent = (amax.to(gl.int32, bitcast=True) >> 23) & 0xFF
    a = gl.minimum(gl.maximum(141 - exponent, -126), 126)
    return ((a + 127) << 23).to(gl.float32, bitcast=True), ((127 - a) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _split(x_s, a_layout: gl.constexpr, rows_layout: gl.constexpr, SQUARES: gl.constexpr = False):
    """A K-tile of x as the products use it: ``x = 2^-a (hi + lo)`` in FP16 with one power
    of two ``2^a`` per row; returns ``hi``, ``lo``, ``hi_c`` (``hi`` for the product with
    ``w_lo``), ``2^-a`` and, with ``SQUARES``, the rows' sums of squares (else their maxima). Inf and NaN inputs reach the tile through ``hi * w_hi``; their
    corrections are made finite by clamps that never bind on finite inputs (``|x - hi| <=
    8`` at this scale; ``maximum`` returns its non-NaN operand), so they change no
    non-finite result (two instructions per element fewer than selects)."""
    x = x_s.load(a_layout)
    row = gl.max(gl.abs(x), axis=1)
    up, down = _pow2_scales(row)
    if SQUARES:
        row = gl.sum(x * x, axis=1)
    x = x * gl.expand_dims(up, 1)
    hi = x.to(gl.float16)
    lo = gl.maximum(x - hi.to(gl.float32), -16.0).to(gl.float16)
    largest = gl.full(hi.shape, 65504.0, gl.float16, a_layout)
    hi_c = gl.minimum(gl.maximum(hi, -largest), largest)
    return hi, lo, hi_c, gl.convert_layout(down, rows_layout), row


@gluon.jit
def _issue(hi, lo, hi_c, hi_s, lo_s, dead):
    """``lo*w_hi + hi_c*w_lo + hi*w_hi`` as asynchronous wgmma groups into a fresh
    accumulator, in the registers of ``dead`` (``use_acc=False``: its values are ignored)."""
    b_hi = hi_s.permute((1, 0))
    tile = warpgroup_mma(lo, b_hi, dead, use_acc=False, is_async=True)
    tile = warpgroup_mma(hi_c, lo_s.permute((1, 0)), tile, is_async=True)
    return warpgroup_mma(hi, b_hi, tile, is_async=True)


@gluon.jit
def _part(unit, M, N, num_k, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, SPLITS: gl.constexpr):
    """Work unit ``unit``: its output tile's (row, column), which of the ``SPLITS`` parts of
    the K-tiles it sums, and their range [first, end) (parts of ``cdiv(num_k, SPLITS)``)."""
    off_m, off_n = tile_offsets(M, N, BM, BN, GROUP_M, unit // SPLITS)
    part = unit % SPLITS
    chunk = gl.cdiv(num_k, SPLITS)
    return off_m, off_n, part, part * chunk, gl.minimum(num_k, (part + 1) * chunk)


@gluon.jit
def _loader(
    x_desc,
    hi_desc,
    lo_desc,
    xs,
    his,
    los,
    ready,
    empty,
    M,
    N,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    SPLITS: gl.constexpr,
):
    """Producer warp: the K-tiles of this program's work units, one after another
    through the ring (the next unit's loads overlap the consumers' epilogue)."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = hi_desc.block_type.shape[0]
    num_k = gl.cdiv(x_desc.shape[1], BK)
    it = 0
    for unit in range(gl.program_id(0), gl.cdiv(M, BM) * gl.cdiv(N, BN) * SPLITS, gl.num_programs(0)):
        off_m, off_n, part, first, end = _part(unit, M, N, num_k, BM, BN, GROUP_M, SPLITS)
        for ki in range(first, end):
            load_stage(x_desc, hi_desc, lo_desc, xs, his, los, ready, empty, it, off_m, off_n, ki * BK, STAGES)
            it += 1


@gluon.jit
def _fp16x3_consumer(
    xs,
    his,
    los,
    ready,
    empty,
    ys,
    y_desc,
    zs,
    z_desc,
    g_desc,
    scale_ptr,
    bias_ptr,
    residual_ptr,
    stride_r,
    table_ptr,
    index_ptr,
    geometry_ptr,
    matrix_ptr,
    inv_k,
    eps,
    M,
    N,
    num_k,
    HAS_BIAS: gl.constexpr,
    HAS_RESIDUAL: gl.constexpr,
    EMBED: gl.constexpr,
    ACTIVATION: gl.constexpr,
    RMS: gl.constexpr,
    KEEP: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    SPLITS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Consumer warpgroups: for each output tile the K loop of :func:`_split` and :func:`_issue`, where
    each K-tile's accumulator joins the FP32 sum (times its rows' ``2^-a``) while the next
    K-tile's products run; then ``act(acc * scale + bias + residual)`` (:mod:`.epilogue`;
    SwiGLU: half the columns) goes to shared memory ``ys``, from where a TMA store writes it
    out while the next tile's K loop runs. With ``SPLITS`` > 1 each work unit sums one part
    of the K-tiles and stores ``acc * scale`` (plus the bias in part 0) at row
    ``part * Mp + row`` of y, ``Mp`` being M rounded up to whole tiles: the caller adds the parts."""
    BM: gl.constexpr = xs.shape[1]
    BN: gl.constexpr = his.shape[1]
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma)
    cols_layout: gl.constexpr = gl.SliceLayout(0, mma)
    zero = gl.zeros((BM, BN), gl.float32, mma)
    it = 0
    for unit in range(gl.program_id(0), gl.cdiv(M, BM) * gl.cdiv(N, BN) * SPLITS, gl.num_programs(0)):
        off_m, off_n, part, first, end = _part(unit, M, N, num_k, BM, BN, GROUP_M, SPLITS)
        acc = zero
        prev = zero
        # K-tile ki splits while ki - 1 runs; ki - 1 joins the sum with no wgmma in
        # flight (ptxas serialises wgmma when accumulators are read around ones in flight);
        # the words of ki - 1 stay alive until its wait (the wgmma read them from registers)
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        hi, lo, hi_c, down, squares = _split(xs.index(s), a_layout, rows_layout, RMS)
        pending = _issue(hi, lo, hi_c, his.index(s), los.index(s), prev)
        for ki in range(first + 1, end):
            it += 1
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            next_hi, next_lo, next_hi_c, next_down, more = _split(xs.index(s), a_layout, rows_layout, RMS)
            if RMS:
                squares = squares + more
            prev, hi, lo, hi_c = warpgroup_mma_wait(num_outstanding=0, deps=(pending, hi, lo, hi_c))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
            acc = acc + prev * gl.expand_dims(down, 1)
            pending = _issue(next_hi, next_lo, next_hi_c, his.index(s), los.index(s), prev)
            hi, lo, hi_c, down = next_hi, next_lo, next_hi_c, next_down
        prev, hi, lo, hi_c = warpgroup_mma_wait(num_outstanding=0, deps=(pending, hi, lo, hi_c))
        mbarrier.arrive(empty.index(it % STAGES), count=1)
        it += 1
        acc = acc + prev * gl.expand_dims(down, 1)
        cols = off_n + gl.arange(0, BN, layout=cols_layout)
        rows = (off_m + gl.arange(0, BM, layout=rows_layout)).to(gl.int64)
        acc = acc * gl.expand_dims(gl.load(scale_ptr + cols, mask=cols < N, other=0.0), 0)
        if RMS:  # the input rows' RMS norm: x / sqrt(mean(x^2) + eps) (its weight is in w)
            acc = acc * gl.expand_dims(gl.rsqrt(gl.convert_layout(squares, rows_layout) * inv_k + eps), 1)
        if HAS_BIAS:
            acc = acc + gl.expand_dims(gl.load(bias_ptr + cols, mask=(cols < N) & (part == 0), other=0.0), 0)
        if HAS_RESIDUAL:
            at = gl.expand_dims(rows * stride_r, 1) + gl.expand_dims(cols, 0)
            inside = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
            acc = acc + gl.load(residual_ptr + at, mask=inside, other=0.0)
        if EMBED:
            acc = gl_embedding(acc, rows, cols, M, N, table_ptr, index_ptr, geometry_ptr, matrix_ptr)
        tma.store_wait(pendings=0)  # the previous tile has left ys, zs (TMA clips rows, columns past M, N)
        gl.thread_barrier()
        if ACTIVATION == 2:  # interleaved value, gate columns: half as many of h
            value, gate = gl.split(gl.reshape(acc, [BM, BN // 2, 2]))
            ys.store(gl_swiglu(value, gate))
            if KEEP:  # the pre-activation for a backward pass, as [v | g]
                zs.index(0).store(value)
                zs.index(1).store(gate)
        else:
            if KEEP:
                zs.index(0).store(acc)
            ys.store(gl_silu(acc) if ACTIVATION == 1 else acc)
        fence_async_shared()
        row = off_m + part * (gl.cdiv(M, BM) * BM)
        tma.async_copy_shared_to_global(y_desc, [row, off_n // 2 if ACTIVATION == 2 else off_n], ys)
        if KEEP:
            tma.async_copy_shared_to_global(z_desc, [off_m, off_n // 2 if ACTIVATION == 2 else off_n], zs.index(0))
            if ACTIVATION == 2:
                tma.async_copy_shared_to_global(g_desc, [off_m, off_n // 2], zs.index(1))
    tma.store_wait(pendings=0)


@gluon.jit
def _fp16x3_kernel(
    x_desc,
    hi_desc,
    lo_desc,
    y_desc,
    z_desc,
    g_desc,
    scale_ptr,
    bias_ptr,
    residual_ptr,
    stride_r,
    table_ptr,
    index_ptr,
    geometry_ptr,
    matrix_ptr,
    inv_k,
    eps,
    M,
    N,
    HAS_BIAS: gl.constexpr,
    HAS_RESIDUAL: gl.constexpr,
    EMBED: gl.constexpr,
    ACTIVATION: gl.constexpr,
    RMS: gl.constexpr,
    KEEP: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    SPLITS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """``y = act((x @ w^T) * scale + bias + residual)``: one program per SM walks the output tiles
    (with ``SPLITS`` > 1: the parts of their K-tiles, each stored on its own rows); a
    producer warp streams their K-tiles (x in FP32, the weight's FP16 words) through a
    ``STAGES``-deep TMA ring, two consumer warpgroups compute, and TMA stores the tiles."""
    xs, his, los, ready, empty = ring(x_desc, hi_desc, lo_desc, STAGES)
    ys = gl.allocate_shared_memory(gl.float32, y_desc.block_type.shape, y_desc.layout)
    ZM: gl.constexpr = z_desc.block_type.shape[0]
    ZN: gl.constexpr = z_desc.block_type.shape[1]
    zs = gl.allocate_shared_memory(gl.float32, [2 if ACTIVATION == 2 else 1, ZM, ZN], z_desc.layout)
    num_k = gl.cdiv(x_desc.shape[1], x_desc.block_type.shape[1])
    gl.warp_specialize(
        [
            (
                _fp16x3_consumer,
                (
                    xs,
                    his,
                    los,
                    ready,
                    empty,
                    ys,
                    y_desc,
                    zs,
                    z_desc,
                    g_desc,
                    scale_ptr,
                    bias_ptr,
                    residual_ptr,
                    stride_r,
                    table_ptr,
                    index_ptr,
                    geometry_ptr,
                    matrix_ptr,
                    inv_k,
                    eps,
                    M,
                    N,
                    num_k,
                    HAS_BIAS,
                    HAS_RESIDUAL,
                    EMBED,
                    ACTIVATION,
                    RMS,
                    KEEP,
                    GROUP_M,
                    STAGES,
                    SPLITS,
                    num_warps,
                ),
            ),
            (_loader, (x_desc, hi_desc, lo_desc, xs, his, los, ready, empty, M, N, GROUP_M, STAGES, SPLITS)),
        ],
        [1],
        [24],
    )


CONFIG = dict(BM=128, BN=128, BK=32, STAGES=4, GROUP_M=8, num_warps=8)
"""Tile shape and pipeline depth (4 stages of 32 KiB, and 64 KiB for the output tile).
Measured alternatives within a few per cent of it, none ahead in every run: 6 stages (before
the output went through shared memory), BK=64 with 3 stages, BM=64 with two CTAs per SM;
BK=16 is 5-10% slower (``docs/design.md``)."""

CANDIDATES = [CONFIG, dict(CONFIG, STAGES=3), dict(CONFIG, STAGES=5)]
"""What :mod:`.autotune` tries per weight shape: :data:`CONFIG` first, all with its K-tile
(which fixes the per-row scales and the order of the sums, so the bits never change).
Not a 64-column tile: tuned on 262,144 rows it won for N = K = 256, and was 20% slower than
:data:`CONFIG` on PET's 700,000 (H200)."""


MIN_SMALL_WORK = 2**20
"""The fewest multiply-adds (M N K) for which fp16x3 runs a product under
:func:`~.triton_gemm.min_rows` itself (:data:`SMALL`, :func:`~.triton_gemm.parts`); lighter
ones run cuBLAS FP32, whose small-product kernels (a large-K kernel with its split-K
reduction and scaling, 12-22 µs a product) take longer than one launch of small tiles.
PET-S's [192 x 1024] -> 256 node products (5e7) took 22 µs each in cuBLAS's large-K kernel;
from 2^25 on, the replayed 192-atom PET-S step's GPU work went from 2.80 to 2.72 ms (H200).
The bundled demo model (d_pet 64) has lighter ones still, [4,608 x 64] -> 64 on a 192-atom
box's edges, [192 x 512] -> 256 and [192 x 256] -> 64 on its atoms: from 2^20 on its direct
evaluation's GPU work went from 0.92 to 0.77 ms and the conservative one's from 1.56 to
1.43 ms (H100, ``torch.profiler`` over 10 calls, two runs agreeing to 0.005 ms)."""


SMALL = dict(CONFIG, **small(SMALL_ROWS))
"""The launch for products with too few rows for :data:`CONFIG`'s tiles to occupy half of
the multiprocessors (:func:`~.triton_gemm.min_rows`): 64-row tiles, one consumer
warpgroup, their K-tiles summed in :func:`parts` (the same K-tile, so one part gives the
bits of :data:`CONFIG`). From half of the multiprocessors on, :data:`CONFIG`'s were as fast
or faster (H200, ``benchmarks/experiments/small_products.py``: [192 x 1536] -> 6144, 96
tiles, 42.5 against 44.1 µs; [6,144 x 128] -> 256, 8.5 against 8.7)."""


class Words(NamedTuple):
    """One direction of a weight [N, K] for fp16x3: FP16 words [2, N, KP] of the
    row-scaled weight, the scales ``2^-b`` [N] that undo it, the fewest rows M that run
    the tuned launch (:func:`~.triton_gemm.min_rows`; fewer run :data:`SMALL` or cuBLAS
    FP32, see :func:`parts`) and that launch's configuration."""

    words: torch.Tensor
    scale: torch.Tensor
    min_rows: int
    config: dict = CONFIG


class Prepared(NamedTuple):
    """A weight [N, K] split once, for y = x w^T (forward) and dx = dy w (backward);
    no words when the weight holds Inf/NaN (then both run cuBLAS FP32)."""

    weight: torch.Tensor
    forward: Words | None
    backward: Words | None


def split_weight(w: torch.Tensor, tune: bool = False) -> Words:
    """The fp16x3 words of a finite FP32 weight [N, K] (K padded to 16-byte rows),
    launched with :data:`CONFIG` or, with ``tune``, the fastest of :data:`CANDIDATES`."""
    n, k = w.shape
    hi, lo, down = split_fp16x3(w)
    words = torch.stack([hi, lo]).half()
    words = torch.nn.functional.pad(words, (0, triton.cdiv(k, 8) * 8 - k)).contiguous()
    split = Words(words, down.contiguous(), min_rows(n, k, w.device))
    if not tune or split.min_rows == NEVER:  # nothing to tune for cuBLAS
        return split
    config = autotune.tuned_gemm("fp16x3", n, k, w.device, CANDIDATES, lambda c: lambda x: launch(x, split, None, c))
    return split._replace(config=config)


def launch(
    x: torch.Tensor,
    w: Words,
    bias: torch.Tensor | None = None,
    config: dict | None = None,
    residual: torch.Tensor | Embedding | None = None,
    activation: str | None = None,
    rms_eps: float | None = None,
    keep: bool = False,
    splits: int = 1,
):
    """``act(x [M, K] @ w^T + bias + residual)`` as [M, N] (:mod:`.epilogue`: the residual a
    tensor or an :class:`~.epilogue.Embedding` computed in the kernel; SwiGLU:
    [M, N // 2] from words of interleaved rows), on the GPU whatever M is (with ``config``,
    default the one ``w`` was tuned for); with ``rms_eps`` each row of the product divided
    by ``sqrt(mean(x^2) + rms_eps)`` over its row of x (an RMS norm before a layer, its
    weight multiplied into ``w``). With ``keep`` (N a multiple of 8), also the
    pre-activation [M, N] (SwiGLU: as ``[v | g]``), stored by TMA like ``y`` (in a pipeline
    of at most :data:`KEEP_STAGES` stages, for the shared memory): returns ``(y, z)``. With
    ``splits`` > 1 (:func:`parts`; a product and its bias only) each output tile is summed
    in that many parts of its K-tiles by as many programs, and the parts are added after."""
    config = config or w.config
    m, k = x.shape
    _, n, kp = w.words.shape
    if m == 0 or k == 0:
        return without_product(m, n, x.device, bias, residual, activation, keep)
    if keep and n % 8:
        raise ValueError(f"keep needs a multiple of 8 columns (16-byte rows of each half), not {n}")
    check_parts(splits, triton.cdiv(k, config["BK"]), plain(residual, activation, rms_eps, keep))
    embed = isinstance(residual, Embedding)
    tensor = residual is not None and not embed
    out = n // 2 if activation == "swiglu" else n
    bm, bn, bk = config["BM"], config["BN"], config["BK"]
    padded = triton.cdiv(m, bm) * bm  # a part's rows: whole tiles, so that no tile's store reaches the next part
    rows = m if splits == 1 else splits * padded
    y = torch.empty((rows, triton.cdiv(out, 4) * 4), device=x.device, dtype=torch.float32)  # 16-byte rows for TMA
    tile = [bm, bn // 2 if activation == "swiglu" else bn]
    if keep:
        z = torch.empty((m, n), device=x.device, dtype=torch.float32)
        halves = z.chunk(2, dim=1) if activation == "swiglu" else (z, z)
        z_desc, g_desc = (descriptor(half, tile) for half in halves)
    else:
        z = None
        z_desc = g_desc = _unused_descriptor(x.device)
    units = triton.cdiv(m, bm) * triton.cdiv(n, bn) * splits
    with on_device(x.device):
        _fp16x3_kernel[(min(units, sm_count(x.device)),)](
            descriptor(tma_ready(x, kp), [bm, bk]),
            descriptor(w.words[0], [bn, bk]),
            descriptor(w.words[1], [bn, bk]),
            descriptor(y, tile),
            z_desc,
            g_desc,
            w.scale,
            bias if bias is not None else y,
            residual if tensor else y,
            residual.stride(0) if tensor else 0,
            *(residual if embed else (y, y, y, y)),
            1.0 / k,
            0.0 if rms_eps is None else rms_eps,
            m,
            n,
            HAS_BIAS=bias is not None,
            HAS_RESIDUAL=tensor,
            EMBED=embed,
            ACTIVATION=ACTIVATIONS[activation],
            RMS=rms_eps is not None,
            KEEP=keep,
            STAGES=min(config["STAGES"], KEEP_STAGES) if keep else config["STAGES"],
            GROUP_M=config["GROUP_M"],
            SPLITS=splits,
            num_warps=config["num_warps"],
        )
    if splits > 1:  # the parts added in a fixed order: torch's sum over the first dimension
        return y.view(splits, padded, -1)[:, :m, :out].sum(0)
    y = y if y.shape[1] == out else y[:, :out].contiguous()
    return (y, z) if keep else y


@functools.cache
def _unused_descriptor(device: torch.device):
    """A small descriptor for the pre-activation's arguments of a launch without ``keep``
    (never read or written), made once per device rather than at every launch."""
    return descriptor(torch.empty((8, 4), device=device), [8, 4])


KEEP_STAGES = 3
"""Pipeline stages with ``keep``: 3 x 32 KiB of operands, 64 KiB for ``y``'s tile and 64 KiB
for the pre-activation's fit the H200's 227 KiB of shared memory per block."""


class Fp16x3Backend:
    """fp16x3 on Hopper through :func:`launch`, with the layer interface of every backend;
    products with few rows run :data:`SMALL` (:func:`parts`); light or narrow ones, and
    weights holding Inf/NaN, run cuBLAS FP32."""

    name = "gluon"
    precision = "fp16x3"

    def prepare(self, weight: torch.Tensor) -> Prepared:
        weight = weight.detach().float().contiguous()
        if not torch.isfinite(weight).all():
            return Prepared(weight, None, None)
        return Prepared(weight, split_weight(weight, tune=True), split_weight(weight.T.contiguous(), tune=True))

    def forward(self, x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.fused(x, prepared, bias)
        return narrow.linear(x, prepared.weight, bias) if y is None else y

    def fused(
        self,
        x: torch.Tensor,
        prepared: Prepared,
        bias: torch.Tensor | None,
        residual: torch.Tensor | Embedding | None = None,
        activation: str | None = None,
        rms_eps: float | None = None,
        keep: bool = False,
    ):
        """``act(x @ weight.T + bias + residual)`` in one kernel (:mod:`.epilogue`; ``rms_eps``,
        ``keep``: see :func:`launch`), or None where :meth:`forward` would not run the
        kernel (the caller composes the steps)."""
        if keep and prepared.forward is not None and prepared.forward.words.shape[1] % 8:
            return None
        bias = None if bias is None else bias.detach().contiguous()
        return _product(x, prepared.forward, bias, residual=residual, activation=activation, rms_eps=rms_eps, keep=keep)

    def grad_input(self, grad_y: torch.Tensor, prepared: Prepared) -> torch.Tensor:
        dx = _product(grad_y, prepared.backward)
        return grad_y @ prepared.weight if dx is None else dx


def _product(x: torch.Tensor, words: Words | None, bias: torch.Tensor | None = None, **epilogue):
    """:func:`launch` with the tuned configuration from ``words.min_rows`` rows, with
    :data:`SMALL` below (in :func:`parts` when there is no epilogue), or None where cuBLAS
    FP32 runs the product (Inf/NaN weights, narrow or light products)."""
    if words is None:
        return None
    if x.shape[0] >= words.min_rows:
        return launch(x, words, bias, **epilogue)
    count = parts(x.shape[0], words.words.shape[1], x.shape[1], x.device, SMALL, MIN_SMALL_WORK)
    if count == 0:
        return None
    return launch(x, words, bias, SMALL, splits=count if plain(**epilogue) else 1, **epilogue)
