"""Gluon building blocks of our Hopper (sm_90) kernels: TMA descriptors, the tile order,
and the shared-memory ring that a producer fills and consumers drain.

Used by the fp16x3 kernel (:mod:`ase_tcfp32._kernels.fp16x3`) and by the experimental Gluon
tf32x3 kernel (``benchmarks/experiments/gluon_tf32x3.py``).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_GL_DTYPES = {torch.float32: gl.float32, torch.float16: gl.float16}


@gluon.jit
def tile_offsets(M, N, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, pid=None):
    """(row, column) of output tile ``pid`` (default: this program's); grouped order:
    GROUP_M row-tiles in a row share the W tiles in L2."""
    if pid is None:
        pid = gl.program_id(0)
    tiles_m = gl.cdiv(M, BM)
    per_group = GROUP_M * gl.cdiv(N, BN)
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    return (first_m + (pid % per_group) % group_rows) * BM, ((pid % per_group) // group_rows) * BN


@gluon.jit
def copy_stage(x_desc, hi_desc, lo_desc, x_s, hi_s, lo_s, bar, off_m, off_n, k):
    """TMA loads of the x tile at (off_m, k) and of both weight-word tiles at (off_n, k)
    into one stage, landing on the barrier ``bar``."""
    mbarrier.expect(bar, x_desc.block_type.nbytes + 2 * hi_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [off_m, k], bar, x_s)
    tma.async_copy_global_to_shared(hi_desc, [off_n, k], bar, hi_s)
    tma.async_copy_global_to_shared(lo_desc, [off_n, k], bar, lo_s)


@gluon.jit
def ring(x_desc, hi_desc, lo_desc, STAGES: gl.constexpr):
    """The shared-memory ring of the warp-specialised kernels: ``STAGES`` tiles of x and of
    the weight's two words, with a "ready" (loads landed) and an "empty" (consumers done)
    barrier per stage."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = hi_desc.block_type.shape[0]
    xs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    his = gl.allocate_shared_memory(hi_desc.dtype, [STAGES, BN, BK], hi_desc.layout)
    los = gl.allocate_shared_memory(lo_desc.dtype, [STAGES, BN, BK], lo_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return xs, his, los, ready, empty


@gluon.jit
def load_stage(x_desc, hi_desc, lo_desc, xs, his, los, ready, empty, it, off_m, off_n, k, STAGES: gl.constexpr):
    """The ring's ``it``-th fill: once the consumers freed its stage, :func:`copy_stage`
    into it, landing on its "ready" barrier."""
    s = it % STAGES
    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
    copy_stage(x_desc, hi_desc, lo_desc, xs.index(s), his.index(s), los.index(s), ready.index(s), off_m, off_n, k)


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[t.dtype])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def tma_ready(x: torch.Tensor, kp: int) -> torch.Tensor:
    """``x`` [M, K] as TMA needs it: 16-byte aligned rows, K zero-padded to ``kp`` (the
    weight words' padded K) when K is not a multiple of 4 (zeros add nothing)."""
    k = x.shape[1]
    if k % 4:
        return torch.nn.functional.pad(x, (0, kp - k))
    if x.stride(1) != 1 or (x.stride(0) * 4) % 16 or x.data_ptr() % 16:
        return x.contiguous()
    return x
