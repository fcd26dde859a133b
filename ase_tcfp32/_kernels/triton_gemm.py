"""Triton GEMM kernels for tf32, tf32x3 and bf16x9 on Ampere and newer GPUs.

``y[M, N] = x[M, K] @ w[N, K]^T (+ bias)`` with ``w`` pre-split into tensor-core words
and stored K-major (``nn.Linear`` layout, as TF32 wgmma wants); ``x`` is split in
registers with the bit rules of :mod:`ase_tcfp32._kernels.split`. The arithmetic is the
one of ``reference.py``: in each K-tile the hi*hi product is formed in a fresh
tensor-core accumulator and joins the FP32 running sum with one IEEE addition; the
small (correction) products go into a second tensor-core accumulator that runs over
all of K and is added at the end. The tile sum is added one iteration late so that
the tensor cores are not waited for right after each product (measured on H200:
1.58-2.23x cuBLAS FP32 on the large PET-S shapes, against 1.41-1.88x when the
corrections were chained into each tile, at the same error; ``docs/design.md``).
On Hopper the tiles come in through TMA descriptors; elsewhere through pointer loads.
The dX backward is the same kernel with the pre-split ``w^T``.

Offsets are int64 (M up to ~1e7 rows), M is not specialised on (no recompilation as
the number of atoms changes), and the tile shape is chosen from (N, K). GEMMs too small
to fill the GPU, and weights holding Inf/NaN, go to cuBLAS FP32 in the FP32-accurate
modes (:func:`min_rows`), or in tf32x3 to 64-row tiles summed in parts of their K-tiles (:func:`parts`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import autotune, narrow
from .context import on_device
from .epilogue import (
    ACTIVATIONS,
    Embedding,
    apply,
    embedding,
    keep,
    without_product,
)
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
def _split_tf32(x):
    """``(hi, lo, hi_c)``: RNA TF32 ``hi``, ``lo = x - hi``, and the ``hi`` the corrections
    use. Inf inputs drop both corrections; NaN inputs reach the result through ``lo``."""
    bits = x.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    rounded = (bits + 0x1000) & -8192
    hi = tl.where(magnitude >= 0x7F7FF000, bits & -8192, rounded).to(tl.float32, bitcast=True)
    infinite = magnitude == 0x7F800000
    return hi, tl.where(infinite, 0.0, x - hi), tl.where(infinite, 0.0, hi)


@triton.jit
def _round_bf16(x):
    """RNE to BF16; a finite x that would round to Inf is truncated instead."""
    rounded = x.to(tl.bfloat16)
    truncated = (x.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True).to(tl.bfloat16)
    overflow = (tl.abs(rounded.to(tl.float32)) == float("inf")) & (tl.abs(x) != float("inf"))
    return tl.where(overflow, truncated, rounded)


@triton.jit
def _split_bf16x3(x):
    """``(w0, w1, w2, w0_c)``: three BF16 words and the ``w0`` the corrections use; the
    corrections of Inf/NaN inputs are dropped (NaN reaches the result through ``w0``)."""
    w0 = _round_bf16(x)
    rest = x - w0.to(tl.float32)
    w1 = _round_bf16(rest)
    w2 = _round_bf16(rest - w1.to(tl.float32))
    finite = tl.abs(x) < float("inf")
    zero = tl.zeros_like(w0)
    return w0, tl.where(finite, w1, zero), tl.where(finite, w2, zero), tl.where(finite, w0, zero)


@triton.jit
def _load_x(x_ptr, x_desc, rm, kk, row0, k0, M, K, stride_xm, TMA: tl.constexpr):
    """The [BM, BK] tile of x, zeros outside."""
    if TMA:
        return x_desc.load([row0, k0])
    return tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)


@triton.jit
def _load_w(w_ptr, w_desc, word, rn, kk, col0, k0, N, KP, TMA: tl.constexpr):
    """The [BK, BN] tile of weight word ``word`` (words stored [WORDS, N, KP]).

    Columns past N read the next word's rows (or zeros): they only feed output
    columns that are never stored."""
    if TMA:
        return w_desc.load([word * N + col0, k0]).T
    return tl.load(
        w_ptr + word * N * KP + rn[None, :] * KP + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < KP), other=0.0
    )


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr,
    x_desc,
    w_ptr,
    w_desc,
    bias_ptr,
    residual_ptr,
    table_ptr,
    index_ptr,
    geometry_ptr,
    matrix_ptr,
    saved_ptr,
    y_ptr,
    M,
    N,
    K,
    KP,
    stride_xm,
    stride_ym,
    stride_s,
    eps,
    WORDS: tl.constexpr,
    TMA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EMBED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    RMS: tl.constexpr,
    KEEP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLITS: tl.constexpr = 1,
):
    # grouped tile order: GROUP_M row-tiles in a row share the W tiles in L2; with SPLITS > 1
    # each program sums one part of the tile's K-tiles and stores it at rows part * Mp + row
    # of y (Mp: M rounded up to whole tiles; the bias in part 0), for the caller to add
    pid = tl.program_id(0) // SPLITS
    part = tl.program_id(0) % SPLITS
    chunk = tl.cdiv(tl.cdiv(K, BK), SPLITS) * BK
    tiles_m = tl.cdiv(M, BM)
    per_group = GROUP_M * tl.cdiv(N, BN)
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    row0, col0 = pid_m * BM, pid_n * BN
    rm = row0.to(tl.int64) + tl.arange(0, BM)
    rn = col0.to(tl.int64) + tl.arange(0, BN)

    acc = tl.zeros((BM, BN), dtype=tl.float32)  # FP32 running sum of the hi*hi tiles
    last = tl.zeros((BM, BN), dtype=tl.float32)  # the previous tile, added one step late
    small = tl.zeros((BM, BN), dtype=tl.float32)  # tensor-core sum of the corrections
    squares = tl.zeros((BM,), dtype=tl.float32)  # with RMS: the rows' sums of squares
    for k0 in range(part * chunk, min(K, (part + 1) * chunk), BK):
        kk = k0 + tl.arange(0, BK)
        a = _load_x(x_ptr, x_desc, rm, kk, row0, k0, M, K, stride_xm, TMA)
        if RMS:
            squares += tl.sum(a * a, axis=1)
        b0 = _load_w(w_ptr, w_desc, 0, rn, kk, col0, k0, N, KP, TMA)
        if WORDS == 1:
            acc = tl.dot(_round_tf32(a), b0, acc, input_precision="tf32")
        elif WORDS == 2:
            b1 = _load_w(w_ptr, w_desc, 1, rn, kk, col0, k0, N, KP, TMA)
            hi, lo, hi_c = _split_tf32(a)
            tile = tl.dot(hi, b0, input_precision="tf32")
            small = tl.dot(lo, b0, small, input_precision="tf32")
            small = tl.dot(hi_c, b1, small, input_precision="tf32")
            acc += last
            last = tile
        else:
            b1 = _load_w(w_ptr, w_desc, 1, rn, kk, col0, k0, N, KP, TMA)
            b2 = _load_w(w_ptr, w_desc, 2, rn, kk, col0, k0, N, KP, TMA)
            a0, a1, a2, a0_c = _split_bf16x3(a)
            tile = tl.dot(a0, b0)
            small = tl.dot(a2, b2, small)  # smallest products first, as in reference.SCHEMES
            small = tl.dot(a2, b1, small)
            small = tl.dot(a1, b2, small)
            small = tl.dot(a2, b0, small)
            small = tl.dot(a1, b1, small)
            small = tl.dot(a0_c, b2, small)
            small = tl.dot(a1, b0, small)
            small = tl.dot(a0_c, b1, small)
            acc += last
            last = tile
    if WORDS > 1:
        acc = (acc + last) + small
    if RMS:  # the input rows' RMS norm: x / sqrt(mean(x^2) + eps) (its weight is in w)
        acc = acc * tl.rsqrt(squares / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=(rn < N) & (part == 0), other=0.0)[None, :]
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + rm[:, None] * stride_ym + rn[None, :], mask=(rm[:, None] < M) & (rn[None, :] < N))
    if EMBED:
        acc = embedding(acc, rm, rn, M, N, table_ptr, index_ptr, geometry_ptr, matrix_ptr)
    if KEEP:  # the pre-activation, for a backward pass
        keep(acc, rm, col0, M, N, saved_ptr, stride_s, ACTIVATION)
    acc = apply(acc, ACTIVATION)
    if ACTIVATION == 2:  # SwiGLU: the tile's interleaved pairs give BN // 2 columns of h
        rn = col0.to(tl.int64) // 2 + tl.arange(0, BN // 2)
        N = N // 2
    at = rm + part * tiles_m * BM
    tl.store(y_ptr + at[:, None] * stride_ym + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def tile_config(n: int, k: int) -> dict:
    """Tile shape and launch parameters for an output width ``n`` and depth ``k``."""
    bn = min(128, max(16, triton.next_power_of_2(n)))
    bk = 32 if k >= 32 else 16
    return dict(BM=128, BN=bn, BK=bk, GROUP_M=8, num_warps=8 if bn >= 128 else 4, num_stages=3)


def tile_candidates(n: int, k: int) -> list[dict]:
    """What :mod:`.autotune` tries for (n, k): :func:`tile_config` first (measured best on
    H200 for PET's shapes), then deeper pipelines and smaller tiles, all with its K-tile."""
    base = tile_config(n, k)
    variants = [
        base,
        dict(base, num_stages=4),
        dict(base, BM=64, num_warps=4, num_stages=4),
        dict(base, BN=max(16, base["BN"] // 2), num_warps=4, num_stages=4),
    ]
    return [c for i, c in enumerate(variants) if c not in variants[:i]]


class Gemm(NamedTuple):
    """One direction of a split weight: words [WORDS, N, KP], launch config, dispatch."""

    words: torch.Tensor  # KP >= K: zero columns for 16-byte rows
    config: dict
    tiles_n: int
    min_rows: int  # fewer rows than this go to cuBLAS FP32 (see min_rows)
    descriptor: object | None  # the words' TMA descriptor (Hopper and newer)


class Prepared(NamedTuple):
    """A weight [N, K] split once, for y = x w^T (forward) and dx = dy w (backward)."""

    weight: torch.Tensor
    forward: Gemm
    backward: Gemm


NEVER = torch.iinfo(torch.int64).max
"""A :func:`min_rows` that no input reaches: the product always runs cuBLAS FP32."""

MIN_OUTPUTS, MIN_TERMS = 16, 8
"""Products with fewer output columns, or fewer terms per sum, than these run cuBLAS FP32
on a GPU at any size: a tile of 128 columns or 32 terms would be mostly padding, and
reading the input bounds them. PET's heads' last layers on [558,336 x 256] rows (H200,
fp16x3 kernel against cuBLAS FP32): 1, 3 and 9 outputs 0.287 / 0.145, 0.296 / 0.263, 0.287 /
0.267 ms; their input gradients, 1, 3 and 9 terms, 0.347 / 0.215, 0.276 / 0.242, 0.259 /
0.305 ms."""


def min_rows(n: int, k: int, device: torch.device) -> int:
    """Rows from which an [M, n] output fills at least half of the GPU's SMs with tiles.

    Below that (PET's node layers at a few hundred atoms: 16-48 tiles of 128 x 128 on
    132 SMs) the three-pass kernel measured 0.2-0.8x cuBLAS FP32 on H200, so the
    FP32-accurate precisions use cuBLAS FP32 there; at 64+ tiles it measured >= 1.1x.
    Narrow products (:data:`MIN_OUTPUTS`, :data:`MIN_TERMS`) never reach it.
    """
    if device.type != "cuda":
        return 0
    if n < MIN_OUTPUTS or k < MIN_TERMS:
        return NEVER
    config = tile_config(n, k)
    tiles_n = triton.cdiv(n, config["BN"])
    return (triton.cdiv(sm_count(device), 2 * tiles_n) - 1) * config["BM"] + 1


PART_TILES = 4
"""The fewest K-tiles in one part of a product summed in parts (:func:`parts`)."""

MIN_SMALL_WORK = 2**27
"""The fewest multiply-adds (M N K) for which a product under :func:`min_rows` runs our
kernel on small tiles (:func:`parts`); lighter ones run cuBLAS FP32. The lightest product
measured was [6,144 x 128] -> 256 (2e8): 8.7 µs in the fp16x3 kernel, 14.0 in cuBLAS FP32
(H200, CUDA graph). fp16x3 takes lighter ones too (:data:`.fp16x3.MIN_SMALL_WORK`)."""


def parts(m: int, n: int, k: int, device: torch.device, config: dict, min_work: int = MIN_SMALL_WORK) -> int:
    """In how many parts of its K-tiles a kernel with ``config``'s tiles (BM, BN, BK: the
    small tiles of products under :func:`min_rows`) sums each output tile of an [m, n]
    product of depth ``k``: the most (a power of two) that keep the work units (tiles times
    parts) within one per multiprocessor, each part :data:`PART_TILES` K-tiles or more; 0
    where cuBLAS FP32 runs it (under ``min_work`` multiply-adds, or narrow).

    Measured on the H200 for fp16x3 (``benchmarks/experiments/small_products.py``, CUDA
    graphs, µs): PET-S's node update at 192 atoms, [192 x 1024] -> 4096, [192 x 2048] ->
    1024 and their input gradients: cuBLAS FP32 63.4, 55.0, 89.8, 42.1; 128-row tiles in
    one part 29.4, 53.1, 101.1, 28.9; this rule (1, 4, 4 and 2 parts of 64-row tiles) 16.8,
    14.1, 20.3, 15.0. PET-M's [192 x 6144] -> 1536 input gradient: 247.0, 150.3, 47.3 (8
    parts: 40.7).
    """
    if n < MIN_OUTPUTS or k < MIN_TERMS or m * n * k < min_work:
        return 0
    tiles = triton.cdiv(m, config["BM"]) * triton.cdiv(n, config["BN"])
    depth = triton.cdiv(k, config["BK"])
    count = 1
    while 2 * count * tiles <= sm_count(device) and depth >= 2 * count * PART_TILES and parts_fit(depth, 2 * count):
        count *= 2
    return count


def parts_fit(depth: int, count: int) -> bool:
    """Whether ``count`` parts of ``cdiv(depth, count)`` K-tiles each leave none empty."""
    return (count - 1) * triton.cdiv(depth, count) < depth


def plain(residual=None, activation: str | None = None, rms_eps: float | None = None, keep: bool = False) -> bool:
    """Whether a launch's epilogue is its bias at most: what a product summed in parts allows."""
    return residual is None and not activation and rms_eps is None and not keep


def check_parts(splits: int, depth: int, bias_only: bool) -> None:
    """A clear error for ``splits`` parts of ``depth`` K-tiles that a launch cannot sum:
    with an epilogue beyond the bias, or with a part left empty."""
    if splits > 1 and not bias_only:
        raise ValueError("a product summed in parts takes a bias only (no residual, activation, norm or keep)")
    if splits > 1 and not parts_fit(depth, splits):
        raise ValueError(f"{splits} parts of {depth} K-tiles would leave the last one empty")


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (asked once per device)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def _has_tma(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _tma_ready(x: torch.Tensor) -> bool:
    """Whether ``x`` [M, K] meets TMA's rules: 16-byte aligned base and row stride."""
    return x.stride(1) == 1 and (x.stride(0) * 4) % 16 == 0 and x.data_ptr() % 16 == 0


def launch(
    x: torch.Tensor,
    gemm: Gemm,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | Embedding | None = None,
    activation: str | None = None,
    rms_eps: float | None = None,
    keep: bool = False,
    rows: int | None = None,
    splits: int = 1,
):
    """``act(x [M, K] @ w^T + bias + residual)`` with the split weight ``gemm``, as [M, N]
    (:mod:`.epilogue`: the residual a tensor or an :class:`~.epilogue.Embedding` computed
    in the kernel; SwiGLU: [M, N // 2] from a weight split with interleaved rows); with
    ``rms_eps`` each row of the product divided by ``sqrt(mean(x^2) + rms_eps)`` over its
    row of x (an RMS norm before the layer, its weight multiplied into ``w``). With
    ``keep``, also the pre-activation [M, N] (SwiGLU: as ``[v | g]``): returns ``(y, z)``.
    ``rows`` replaces the tile's rows of ``gemm.config`` (:func:`small`); with ``splits`` > 1
    (:func:`parts`; a product and its bias only) each output tile is summed in that many
    parts of its K-tiles by as many programs, and the parts are added after."""
    m, k = x.shape
    words, n, kp = gemm.words.shape
    config = dict(gemm.config, **({} if rows is None else small(rows)))
    check_parts(splits, triton.cdiv(k, config["BK"]), plain(residual, activation, rms_eps, keep))
    out = n // 2 if activation == "swiglu" else n
    padded = triton.cdiv(m, config["BM"]) * config["BM"]  # a part's rows: whole tiles
    y = torch.empty((m if splits == 1 else splits * padded, out), device=x.device, dtype=torch.float32)
    z = torch.empty((m, n), device=x.device, dtype=torch.float32) if keep else None
    if m == 0:
        return (y, z) if keep else y
    embed = isinstance(residual, Embedding)
    tensor = residual is not None and not embed
    if k == 0:
        return without_product(m, n, x.device, bias, residual, activation, keep)
    tma = gemm.descriptor is not None and _tma_ready(x)
    x_desc = None
    if tma:
        x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [config["BM"], config["BK"]])
    grid = (triton.cdiv(m, config["BM"]) * gemm.tiles_n * splits,)
    with on_device(x.device):
        _linear_kernel[grid](
            x,
            x_desc,
            gemm.words,
            gemm.descriptor if tma else None,
            bias if bias is not None else y,
            residual if tensor else y,
            *(residual if embed else (y, y, y, y)),
            y if z is None else z,
            y,
            m,
            n,
            k,
            kp,
            x.stride(0),
            y.stride(0),
            0 if z is None else z.stride(0),
            0.0 if rms_eps is None else rms_eps,
            WORDS=words,
            TMA=tma,
            HAS_BIAS=bias is not None,
            HAS_RESIDUAL=tensor,
            EMBED=embed,
            ACTIVATION=ACTIVATIONS[activation],
            RMS=rms_eps is not None,
            KEEP=keep,
            SPLITS=splits,
            **config,
        )
    if splits > 1:  # the parts added in a fixed order: torch's sum over the first dimension
        return y.view(splits, padded, out)[:, :m].sum(0)
    return (y, z) if keep else y


SMALL_ROWS = 64
"""The tiles' rows for products under :func:`min_rows` (one warpgroup; see :func:`parts`)."""


def small(rows: int) -> dict:
    """The launch parameters that change for tiles of ``rows`` rows (64: one warpgroup)."""
    return dict(BM=rows, num_warps=4)


class TritonBackend:
    """Our Triton kernels, with the layer interface of every backend.

    GEMMs with too few rows to fill the GPU (:func:`min_rows`) run 64-row tiles summed in
    :func:`parts` in tf32x3 and cuBLAS FP32 in bf16x9; light or narrow ones run cuBLAS FP32,
    and so do weights holding Inf/NaN (their outputs are Inf/NaN wherever torch's are);
    single-pass tf32 always runs its tuned kernel.
    """

    name = "triton"
    launch = staticmethod(launch)
    """The kernel launcher (subclasses with other kernels replace it)."""

    def __init__(self, precision: str):
        self.precision = precision

    def _words(self, w: torch.Tensor) -> torch.Tensor:
        if self.precision == "tf32":
            return round_tf32(w).unsqueeze(0)
        if self.precision == "tf32x3":
            hi = round_tf32(w)
            return torch.stack([hi, w - hi])
        return torch.stack(split_bf16x3(w)).to(torch.bfloat16)  # exact: the words are BF16

    def gemm(self, w: torch.Tensor, finite: bool = True, config: dict | None = None, tune: bool = False) -> Gemm:
        """``w`` [N, K] split for ``y = x w^T``, launched with ``config`` (default
        :func:`tile_config` or, with ``tune``, the fastest of :func:`tile_candidates`)."""
        n, k = w.shape
        rows = 0 if self.precision == "tf32" else min_rows(n, k, w.device)
        if not finite and self.precision != "tf32":
            rows = NEVER
        config = config or (self._tuned(w, finite) if tune and rows < NEVER else tile_config(n, k))
        words = self._words(w)
        kp = triton.cdiv(k, 8) * 8  # 16-byte rows for TMA, in FP32 and BF16 alike
        words = torch.nn.functional.pad(words, (0, kp - k)).contiguous()
        descriptor = None
        if _has_tma(w.device):
            flat = words.view(-1, kp)
            descriptor = TensorDescriptor(flat, list(flat.shape), [kp, 1], [config["BN"], config["BK"]])
        return Gemm(words, config, triton.cdiv(n, config["BN"]), rows, descriptor)

    def _tuned(self, w: torch.Tensor, finite: bool) -> dict:
        n, k = w.shape
        candidates = tile_candidates(n, k)
        if w.device.type != "cuda":
            return candidates[0]

        def launcher(config: dict):
            gemm = self.gemm(w, finite, config)
            return lambda x: self.launch(x, gemm)

        return autotune.tuned_gemm(f"{self.name} {self.precision}", n, k, w.device, candidates, launcher)

    def prepare(self, weight: torch.Tensor) -> Prepared:
        """Words of ``weight`` [N, K] and of its transpose, each [WORDS, rows, KP]."""
        weight = weight.detach().float().contiguous()
        finite = bool(torch.isfinite(weight).all())
        return Prepared(
            weight, self.gemm(weight, finite, tune=True), self.gemm(weight.T.contiguous(), finite, tune=True)
        )

    def forward(self, x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None) -> torch.Tensor:
        y = self._product(x, prepared.forward, None if bias is None else bias.detach().contiguous())
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
        bias = None if bias is None else bias.detach().contiguous()
        return self._product(
            x, prepared.forward, bias, residual=residual, activation=activation, rms_eps=rms_eps, keep=keep
        )

    def grad_input(self, grad_y: torch.Tensor, prepared: Prepared) -> torch.Tensor:
        dx = self._product(grad_y, prepared.backward)
        return grad_y @ prepared.weight if dx is None else dx

    def _product(self, x: torch.Tensor, gemm: Gemm, bias: torch.Tensor | None = None, **epilogue):
        """:meth:`launch` from ``gemm.min_rows`` rows on; below, in tf32x3, :func:`launch` on
        64-row tiles (in :func:`parts` when there is no epilogue); None where cuBLAS FP32 runs
        the product (light or narrow products, Inf/NaN weights, bf16x9 below ``min_rows``:
        its nine products on small tiles were not measured)."""
        if x.shape[0] >= gemm.min_rows:
            return self.launch(x, gemm, bias, **epilogue)
        if self.precision != "tf32x3" or gemm.min_rows == NEVER:
            return None
        count = parts(x.shape[0], gemm.words.shape[1], x.shape[1], x.device, dict(gemm.config, **small(SMALL_ROWS)))
        if count == 0:
            return None
        return launch(x, gemm, bias, **epilogue, rows=SMALL_ROWS, splits=count if plain(**epilogue) else 1)
