"""FP32-accurate attention on tensor cores for PET's short sequences (Triton).

PET's transformer attends, for each of B atoms, over T = J + 1 tokens (the atom and its J
neighbor slots: ~25-50) in H heads of width D (PET-S 8 x 32, PET-M 8 x 48), with an
additive mask [B, T, T] shared by the heads (the log of the cutoff weights). Torch's FP32
``scaled_dot_product_attention`` runs CUTLASS's sm80 memory-efficient kernel on 64 x 64
tiles, one (atom, head) per tile.

Here one program takes a block of ``BLOCK`` consecutive rows of the token matrix that
holds ``PACK = BLOCK // T`` whole sequences (atoms ``b0 .. b0 + PACK - 1``: rows
``b*T .. b*T + T - 1``), and loops over the H heads. A block's scores are one
``BLOCK x BLOCK`` product whose off-diagonal blocks (a key of another atom) are masked
to -inf, so packing costs products on the tensor cores, not memory traffic. The softmax
of a row is complete in registers (T <= BLOCK): no running maximum, and the backward
recomputes the probabilities instead of saving them. It needs neither the output nor
the log-sum-exp: ``rowsum(dO * O) = rowsum(P * dP)``.

Every product is TF32x3 on tensor cores (``hi*hi`` in its own accumulator, ``lo*hi +
hi*lo`` in a second, as in :mod:`.triton_gemm`); ``P @ V`` splits V into three TF32
words that sum to V exactly, so that a row whose probabilities are one-hot (a mask of
-inf but for one key) returns that key's value exactly. TF32 words rather than fp16x3:
they have FP32's range (no per-row scaling of logits or of probabilities down to 1e-15),
and the kernels are bound by registers and latency, not by the tensor cores' rate
(``docs/design.md``). The softmax and every sum are FP32 on CUDA cores.
On the H200: 2.2x torch's FP32 SDPA forward + backward at PET-S's shapes
(``benchmarks/attention.py``; the packed kernels below: 3.9x).

Layouts, as PET's projections read and write them (no transposed copies):
``qkv`` [B*T, 3*H*D] (query, key, value of head h at columns ``h*D``, ``C + h*D``,
``2C + h*D`` with C = H*D), ``out`` [B*T, C], ``mask`` [B, T, T]. The forward reads a
head whose width is not a power of two as two chunks that are (:func:`head_columns`:
PET-M's 48 = 32 + 16), each product of the head being the sum of the chunks' products;
the backward pads it with zero columns (:func:`padded_columns`).

The packed kernels (:func:`forward_packed`, what the lean engine runs) take sequences of
different lengths stored without padding; their blocks hold whole sequences, as many as
fit, chosen on the device each call (:func:`fit_blocks`): 3.9x torch's FP32 SDPA forward +
backward with PET-S's water sequences at 17,280 atoms. Small systems have too few blocks
to fill the GPU: their launches also split each block's heads into groups, one program
per block and group (:func:`head_groups`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .context import on_device
from .triton_gemm import _round_tf32, sm_count


@triton.jit
def _split(x):
    """``(hi, lo)``: ``hi`` = x rounded to TF32, ``lo = x - hi`` (exact; the tensor cores
    read its top TF32 bits). Inf gives a NaN ``lo``: non-finite inputs give NaN."""
    hi = _round_tf32(x)
    return hi, x - hi


@triton.jit
def _dot3(a, b):
    """``a @ b`` in TF32x3 (FP32 accuracy): ``hi*hi + (lo*hi + hi*lo)``."""
    a_hi, a_lo = _split(a)
    b_hi, b_lo = _split(b)
    small = tl.dot(a_lo, b_hi, input_precision="tf32")
    small = tl.dot(a_hi, b_lo, small, input_precision="tf32")
    return tl.dot(a_hi, b_hi, input_precision="tf32") + small


@triton.jit
def _dot3_chunks(a, b, a2, b2):
    """``a @ b + a2 @ b2`` in TF32x3, each sum chained in one accumulator as in :func:`_dot3`
    (a head read in two column chunks: the same products as one of their summed width)."""
    a_hi, a_lo = _split(a)
    b_hi, b_lo = _split(b)
    a2_hi, a2_lo = _split(a2)
    b2_hi, b2_lo = _split(b2)
    small = tl.dot(a_lo, b_hi, input_precision="tf32")
    small = tl.dot(a_hi, b_lo, small, input_precision="tf32")
    small = tl.dot(a2_lo, b2_hi, small, input_precision="tf32")
    small = tl.dot(a2_hi, b2_lo, small, input_precision="tf32")
    big = tl.dot(a_hi, b_hi, input_precision="tf32")
    return tl.dot(a2_hi, b2_hi, big, input_precision="tf32") + small


@triton.jit
def _dot3_exact_b(a, b):
    """``a @ b`` with ``b`` in three TF32 words (``b_hi + b_mid + b_lo == b``): a one-hot
    row of ``a`` picks a row of ``b`` exactly."""
    a_hi, a_lo = _split(a)
    b_hi, b_rest = _split(b)
    b_mid, b_lo = _split(b_rest)
    small = tl.dot(a_hi, b_lo, input_precision="tf32")
    small = tl.dot(a_lo, b_hi, small, input_precision="tf32")
    small = tl.dot(a_hi, b_mid, small, input_precision="tf32")
    return tl.dot(a_hi, b_hi, input_precision="tf32") + small


@triton.jit
def _block(pid, B, T, BLOCK: tl.constexpr):
    """The rows of block ``pid``: token-matrix row, whether it is real, its sequence."""
    pack = BLOCK // T
    r = tl.arange(0, BLOCK)
    seq = r // T
    atom = pid.to(tl.int64) * pack + seq
    real = (seq < pack) & (atom < B)
    row = atom * T + (r - seq * T)
    return row, real, seq, atom


@triton.jit
def _scores_bias(mask_ptr, T, row, real, seq, atom, BLOCK: tl.constexpr):
    """The additive mask of the block [BLOCK, BLOCK]: the atom's mask on its diagonal
    block, -inf elsewhere, 0 on padding rows (finite: they are never stored)."""
    tok = row - atom * T
    same = (seq[:, None] == seq[None, :]) & real[:, None] & real[None, :]
    offsets = atom[:, None] * T * T + tok[:, None] * T + tok[None, :]
    bias = tl.load(mask_ptr + offsets, mask=same, other=float("-inf"))
    return tl.where(real[:, None], bias, 0.0), offsets, same


@triton.jit
def _program_block(mask_ptr, B, T, BLOCK: tl.constexpr):
    """This program's block: token rows [BLOCK], which are real, and the scores' bias
    [BLOCK, BLOCK] (with the mask's offsets and where it applies)."""
    row, real, seq, atom = _block(tl.program_id(0), B, T, BLOCK)
    bias, offsets, same = _scores_bias(mask_ptr, T, row, real, seq, atom, BLOCK)
    return row, real, bias, offsets, same


@triton.jit
def _minimum(a, b):
    return tl.minimum(a, b)


@triton.jit(do_not_specialize=["B", "T", "slots"])
def _fit_blocks(counts_ptr, order_ptr, blocks_ptr, B, T, slots, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """The blocks of the sequences of atoms ``c * CHUNK .. (c + 1) * CHUNK - 1`` (c: this
    program; atom a's sequence: ``counts[a] + 1`` tokens, at most T <= BLOCK), see
    :func:`fit_blocks`: their order into ``order`` (atoms), each block's (first position
    in ``order``, atoms) into this chunk's ``slots`` rows of ``blocks`` [chunks * slots, 2],
    0 atoms in the rows left over."""
    first = tl.program_id(0).to(tl.int64) * CHUNK
    i = tl.arange(0, CHUNK)
    inside = first + i < B
    # the chunk by length (past the last atom: longer than a block), then the pairing
    length = tl.minimum(tl.load(counts_ptr + first + i, mask=inside, other=BLOCK) + 1, tl.where(inside, T, BLOCK + 1))
    key = tl.sort(length.to(tl.int32) * CHUNK + i)
    s, atom = key // CHUNK, key % CHUNK
    short = tl.sum((s <= BLOCK // 2).to(tl.int32), 0)  # the short ones: s[:short]; the long ones after them
    long = tl.sum(inside.to(tl.int32), 0) - short
    # pairs (j, short + m - 1 - j) for j < m fit iff m <= fits[j] + j + 1 for every j < m, fits[j] being the
    # last long one that fits with short one j, counted from the first long one
    fits = tl.sum((s[None, :] <= BLOCK - s[:, None]).to(tl.int32), 1) - 1 - short
    bound = tl.associative_scan(tl.where(i < short, fits + i + 1, CHUNK), 0, _minimum)
    m = tl.sum(((i + 1 <= bound) & (i + 1 <= short) & (i + 1 <= long)).to(tl.int32), 0)
    half = i // 2
    source = tl.where(i < 2 * m, tl.where(i % 2 == 0, half, short + m - 1 - half), tl.where(i < short + m, i - m, i))
    tl.store(order_ptr + first + i, first + atom, mask=inside)
    tl.debug_barrier()
    arranged = tl.load(order_ptr + first + source, mask=inside)
    tl.debug_barrier()
    tl.store(order_ptr + first + i, arranged, mask=inside)
    tl.debug_barrier()
    # next-fit: serial, ~1 us per 10 atoms on the H200
    table = blocks_ptr + 2 * slots * tl.program_id(0).to(tl.int64)
    start, used, atoms, filled = first, first * 0, first * 0, first * 0
    for j in range(CHUNK):
        position = first + j
        a = tl.load(order_ptr + position, mask=position < B, other=0)
        size = tl.minimum(tl.load(counts_ptr + a, mask=position < B, other=-1) + 1, T)  # 0 past the last atom
        full = used + size > BLOCK  # the block is closed: this atom starts the next one
        tl.store(table + 2 * filled, start, mask=full)
        tl.store(table + 2 * filled + 1, atoms, mask=full)
        filled += full.to(tl.int64)
        start = tl.where(full, position, start)
        used = tl.where(full, size, used + size)
        atoms = tl.where(full, 1, atoms + (size > 0).to(tl.int64))
    tl.store(table + 2 * filled, start, mask=atoms > 0)
    tl.store(table + 2 * filled + 1, atoms, mask=atoms > 0)
    filled += (atoms > 0).to(tl.int64)
    tl.store(table + 2 * i + 1, i.to(tl.int64) * 0, mask=(i >= filled) & (i < slots))


@triton.jit
def _packed_block(bias_ptr, first_ptr, counts_ptr, order_ptr, p0, atoms, T, BLOCK: tl.constexpr):
    """The block of the packed sequences of atoms ``order[p0 .. p0 + atoms - 1]``, one after
    the other (:func:`fit_blocks`): for each of its BLOCK token slots, the atom, the edge row
    of a neighbor token, whether the slot is real and whether it is the atom's center token;
    and the scores' bias [BLOCK, BLOCK]."""
    r = tl.arange(0, BLOCK)
    # each slot's sequence, atom and first slot, sequence by sequence (elementwise: the slots keep the layout
    # the head loop reads them in; reductions over [BLOCK, BLOCK] here cost PET-M's backward 60%)
    seq, atom, begin, start = tl.zeros((BLOCK,), tl.int64), tl.zeros((BLOCK,), tl.int64), r * 0, p0.to(tl.int32) * 0
    for j in range(0, atoms):
        a = tl.load(order_ptr + p0 + j)
        here = r >= start
        seq, atom, begin = tl.where(here, j, seq), tl.where(here, a, atom), tl.where(here, start, begin)
        start += tl.minimum(tl.load(counts_ptr + a) + 1, T).to(tl.int32)
    tok = r - begin
    real = r < start
    edge = tl.load(first_ptr + atom, mask=real, other=1) + tok - 1
    return atom, edge, real, tok == 0, _key_bias(bias_ptr, edge, real, tok == 0, seq)


@triton.jit
def _key_bias(bias_ptr, edge, real, center, seq):
    """The additive mask [BLOCK, BLOCK] of a packed block: each key's bias (0 for a center
    token) within its sequence, -inf elsewhere, 0 on padding rows."""
    key = tl.load(bias_ptr + edge, mask=real & (center == 0), other=0.0)
    same = (seq[:, None] == seq[None, :]) & real[:, None] & real[None, :]
    bias = tl.where(same, key[None, :], float("-inf"))
    return tl.where(real[:, None], bias, 0.0)


@triton.jit
def _rows(edge_ptr, node_ptr, atom, edge, center, width: tl.constexpr):
    """Pointers [BLOCK, 1] to the rows of a packed block's tokens in row-major tensors of
    ``width`` columns: a center token's row of the nodes' tensor, a neighbor's of the edges'."""
    return tl.where(center[:, None], node_ptr + atom[:, None] * width, edge_ptr + edge[:, None] * width)


@triton.jit
def _columns(real, first: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """Offsets [1, DP] of the columns ``first .. first + DP - 1`` of a head, and where they
    are real [BLOCK, DP] (``first + DP`` past ``D``: padding)."""
    d = first + tl.arange(0, DP)
    return d[None, :], real[:, None] & (d < D)[None, :]


@triton.jit
def _head(inputs, io, C: tl.constexpr):
    """A head's queries, keys and values at the pointers ``inputs`` [BLOCK, DP] to its
    query columns (keys C, values 2C further), zero outside ``io``."""
    q = tl.load(inputs, mask=io, other=0.0)
    k = tl.load(inputs + C, mask=io, other=0.0)
    v = tl.load(inputs + 2 * C, mask=io, other=0.0)
    return q, k, v


@triton.jit
def _softmax(s):
    """Softmax by rows of the scores [BLOCK, BLOCK]."""
    p = tl.exp(s - tl.max(s, 1)[:, None])
    return p / tl.sum(p, 1)[:, None]


@triton.jit
def _forward_heads(
    inputs,
    outputs,
    real,
    bias,
    scale,
    H: tl.constexpr,
    HEADS: tl.constexpr,
    D: tl.constexpr,
    DA: tl.constexpr,
    DB: tl.constexpr,
    STAGES: tl.constexpr,
):
    """A block's attention in ``HEADS`` of the H heads, head by head: ``inputs`` [BLOCK, 1]
    point to its tokens' rows of qkv, ``outputs`` [BLOCK, 1] to their rows of the output,
    both at the first of these heads' columns; ``bias`` [BLOCK, BLOCK]."""
    C: tl.constexpr = H * D
    for h in tl.range(0, HEADS, num_stages=STAGES):
        a, io_a = _columns(real, 0, D, DA)  # the head's first DA columns
        q, k, v = _head(inputs + h * D + a, io_a, C)
        if DB > 0:  # and its last DB columns
            b, io_b = _columns(real, DA, D, DB)
            q_b, k_b, v_b = _head(inputs + h * D + b, io_b, C)
            s = _dot3_chunks(q, tl.trans(k), q_b, tl.trans(k_b))
        else:
            s = _dot3(q, tl.trans(k))
        p = _softmax(s * scale + bias)
        tl.store(outputs + h * D + a, _dot3_exact_b(p, v), mask=io_a)
        if DB > 0:
            tl.store(outputs + h * D + b, _dot3_exact_b(p, v_b), mask=io_b)


@triton.jit
def _backward_head(
    inputs,
    grad_outputs,
    grad_inputs,
    real,
    bias,
    scale,
    h,
    grad_bias,
    C: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    COLUMNS: tl.constexpr,
):
    """The gradients of :func:`_forward_heads` for head ``h`` with respect to qkv (stored at
    ``grad_inputs`` [BLOCK, 1]) for the output gradient at ``grad_outputs``; returns
    ``grad_bias`` plus the gradient of the head's scores [BLOCK, BLOCK] (``COLUMNS``: plus
    its column sums [BLOCK], a bias per key's share)."""
    x, io = _columns(real, 0, D, DP)  # the head's columns, padded to DP
    q, k, v = _head(inputs + h * D + x, io, C)
    do = tl.load(grad_outputs + h * D + x, mask=io, other=0.0)
    p = _softmax(_dot3(q, tl.trans(k)) * scale + bias)
    grads = grad_inputs + h * D + x
    tl.store(grads + 2 * C, _dot3(tl.trans(p), do), mask=io)  # dV = P^T dO
    dp = _dot3(do, tl.trans(v))
    ds = p * (dp - tl.sum(p * dp, 1)[:, None])  # the gradient of the masked scores
    if COLUMNS:
        grad_bias += tl.sum(ds, 0)
    else:
        grad_bias += ds
    ds = ds * scale
    tl.store(grads, _dot3(ds, k), mask=io)  # dQ
    tl.store(grads + C, _dot3(tl.trans(ds), q), mask=io)  # dK
    return grad_bias


@triton.jit(do_not_specialize=["B", "T"])
def _attention_forward(
    qkv_ptr,
    mask_ptr,
    out_ptr,
    B,
    T,
    scale,
    H: tl.constexpr,
    D: tl.constexpr,
    DA: tl.constexpr,
    DB: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    row, real, bias, _offsets, _same = _program_block(mask_ptr, B, T, BLOCK)
    C: tl.constexpr = H * D
    _forward_heads(
        qkv_ptr + row[:, None] * 3 * C, out_ptr + row[:, None] * C, real, bias, scale, H, H, D, DA, DB, STAGES
    )


@triton.jit(do_not_specialize=["B", "T"])
def _attention_backward(
    qkv_ptr,
    mask_ptr,
    grad_out_ptr,
    grad_qkv_ptr,
    grad_mask_ptr,
    B,
    T,
    scale,
    H: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    row, real, bias, offsets, same = _program_block(mask_ptr, B, T, BLOCK)
    C: tl.constexpr = H * D
    grad_bias = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)  # summed over the heads
    for h in tl.range(0, H, num_stages=STAGES):
        grad_bias = _backward_head(
            qkv_ptr + row[:, None] * 3 * C,
            grad_out_ptr + row[:, None] * C,
            grad_qkv_ptr + row[:, None] * 3 * C,
            real,
            bias,
            scale,
            h,
            grad_bias,
            C,
            D,
            DP,
            False,
        )
    tl.store(grad_mask_ptr + offsets, grad_bias, mask=same)


@triton.jit
def _zero_tail(ptr, total_ptr, E, start, width: tl.constexpr, BLOCK: tl.constexpr):
    """Zeros into rows ``start .. start + BLOCK - 1`` of a row-major [E, width] tensor where
    they are past the ``*total_ptr`` real rows: the padding rows no sequence holds."""
    r = start + tl.arange(0, BLOCK)
    rows = (r >= tl.load(total_ptr)) & (r < E)
    for first in tl.static_range(0, width, 64):
        c = first + tl.arange(0, 64)
        tl.store(
            ptr + r[:, None] * width + c[None, :],
            tl.zeros((BLOCK, 64), dtype=tl.float32),
            mask=rows[:, None] & (c < width)[None, :],
        )


@triton.jit
def _slot_group(pid, GROUPS: tl.constexpr):
    """The block slot and the group of heads of program ``pid``, one of the packed kernels'
    first ``slots * GROUPS`` (:func:`head_groups`): each slot's groups one after the other."""
    return pid // GROUPS, pid % GROUPS


@triton.jit(do_not_specialize=["slots", "T", "E"])
def _packed_forward(
    qkv_ptr,
    node_qkv_ptr,
    bias_ptr,
    first_ptr,
    counts_ptr,
    order_ptr,
    blocks_ptr,
    total_ptr,
    out_ptr,
    node_out_ptr,
    slots,
    T,
    E,
    scale,
    H: tl.constexpr,
    HEADS: tl.constexpr,
    D: tl.constexpr,
    DA: tl.constexpr,
    DB: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    C: tl.constexpr = H * D
    GROUPS: tl.constexpr = H // HEADS
    pid = tl.program_id(0)
    if pid < slots * GROUPS:
        slot, group = _slot_group(pid, GROUPS)
        a0, atoms = tl.load(blocks_ptr + 2 * slot), tl.load(blocks_ptr + 2 * slot + 1)
        if atoms > 0:
            atom, edge, real, center, bias = _packed_block(
                bias_ptr, first_ptr, counts_ptr, order_ptr, a0, atoms, T, BLOCK
            )
            head = group * HEADS * D  # the group's first head's columns
            _forward_heads(
                _rows(qkv_ptr, node_qkv_ptr, atom, edge, center, 3 * C) + head,
                _rows(out_ptr, node_out_ptr, atom, edge, center, C) + head,
                real,
                bias,
                scale,
                H,
                HEADS,
                D,
                DA,
                DB,
                STAGES,
            )
    else:  # the edge rows past the real ones
        _zero_tail(out_ptr, total_ptr, E, (pid - slots * GROUPS).to(tl.int64) * BLOCK, C, BLOCK)


@triton.jit(do_not_specialize=["slots", "T", "E"])
def _packed_backward(
    qkv_ptr,
    node_qkv_ptr,
    bias_ptr,
    first_ptr,
    counts_ptr,
    order_ptr,
    blocks_ptr,
    total_ptr,
    grad_out_ptr,
    node_grad_out_ptr,
    grad_qkv_ptr,
    node_grad_qkv_ptr,
    grad_bias_ptr,
    slots,
    T,
    E,
    scale,
    H: tl.constexpr,
    HEADS: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    C: tl.constexpr = H * D
    GROUPS: tl.constexpr = H // HEADS
    pid = tl.program_id(0)
    if pid < slots * GROUPS:
        slot, group = _slot_group(pid, GROUPS)
        a0, atoms = tl.load(blocks_ptr + 2 * slot), tl.load(blocks_ptr + 2 * slot + 1)
        if atoms > 0:
            atom, edge, real, center, bias = _packed_block(
                bias_ptr, first_ptr, counts_ptr, order_ptr, a0, atoms, T, BLOCK
            )
            head = group * HEADS * D  # the group's first head's columns
            inputs = _rows(qkv_ptr, node_qkv_ptr, atom, edge, center, 3 * C) + head
            grad_outputs = _rows(grad_out_ptr, node_grad_out_ptr, atom, edge, center, C) + head
            grad_inputs = _rows(grad_qkv_ptr, node_grad_qkv_ptr, atom, edge, center, 3 * C) + head
            # each key's bias is shared by its sequence's queries: the sums of its columns, over the group's heads
            grad_bias = tl.zeros((BLOCK,), dtype=tl.float32)
            for h in tl.range(0, HEADS, num_stages=STAGES):
                grad_bias = _backward_head(
                    inputs, grad_outputs, grad_inputs, real, bias, scale, h, grad_bias, C, D, DP, True
                )
            tl.store(grad_bias_ptr + edge * GROUPS + group, grad_bias, mask=real & (center == 0))
    else:
        start = (pid - slots * GROUPS).to(tl.int64) * BLOCK
        _zero_tail(grad_qkv_ptr, total_ptr, E, start, 3 * C, BLOCK)
        _zero_tail(grad_bias_ptr, total_ptr, E, start, GROUPS, BLOCK)  # [E, GROUPS]: each group's sums


def padded_columns(head_dim: int) -> int:
    """The columns, a power of two, in which the backward kernel reads a head (zeros past
    ``head_dim``)."""
    return max(16, triton.next_power_of_2(head_dim))


def head_columns(head_dim: int) -> tuple[int, int]:
    """``(DA, DB)``: the forward kernel reads a head in two column chunks of powers of two,
    DA + DB = ``head_dim`` (DB >= 16; PET-M's 48 = 32 + 16), or in one of DA >= ``head_dim``
    columns (DB = 0), padded with zeros when ``head_dim`` is not a power of two (24 -> 32).
    Measured on the H200, PET-M at 17,280 atoms (``benchmarks/experiments/attention_variants.py``):
    forward 4.77 ms chunked against 5.82 padded; the backward, whose six products per head
    become nine, 19.38 against 18.74, so it stays padded (:func:`padded_columns`)."""
    first = padded_columns(head_dim)
    if first == head_dim or first == 16:
        return first, 0
    rest = head_dim - first // 2
    return (first // 2, rest) if rest >= 16 and rest == triton.next_power_of_2(rest) else (first, 0)


def max_tokens(head_dim: int) -> int:
    """The longest sequence the kernels take with heads of ``head_dim`` (0: none). 128-row
    blocks with heads wider than 32 need more shared memory than an H200 has."""
    return 128 if head_dim <= 32 else 64 if head_dim <= 64 else 0


def config(tokens: int, head_dim: int, backward: bool = False) -> dict:
    """Block size and launch parameters of the forward (or ``backward``) kernel for
    sequences of ``tokens`` and heads of ``head_dim``. Measured on the H200
    (``benchmarks/attention.py``): 64-row blocks with 4 warps beat
    128-row blocks of 3 packed sequences at PET-S's 40 tokens (2.2x against 1.1x SDPA
    forward + backward); a second pipeline stage over the heads helps every forward (PET-M,
    17,280 atoms: 5.8 against 7.4 ms) but only the backward of heads up to 32 wide (PET-M's
    backward: ~18.8 ms with one stage, ~26.1 with two)."""
    if tokens > 64:  # one to two sequences per block; the backward's shared memory allows one stage
        return dict(BLOCK=128, num_warps=8, STAGES=1)
    return dict(BLOCK=64, num_warps=4, STAGES=2 if head_dim <= 32 or not backward else 1)


def launch_shape(
    qkv: torch.Tensor, mask: torch.Tensor, heads: int, launch: dict | None = None, backward: bool = False
) -> tuple:
    """``(atoms, tokens, head_dim, grid, constants)`` of a launch on ``qkv`` [B, T, 3*H*D]
    and ``mask`` [B, T, T] (checked: a clear error before any launch), ``constants`` being
    the forward (or ``backward``) kernel's compile-time arguments with ``launch`` (default
    :func:`config`)."""
    atoms, tokens, width = qkv.shape
    if width % (3 * heads) or mask.shape != (atoms, tokens, tokens):
        raise ValueError(
            f"qkv [B, T, 3*H*D] and mask [B, T, T] expected, got {tuple(qkv.shape)} and {tuple(mask.shape)}"
        )
    head_dim = width // (3 * heads)
    constants = _constants(tokens, heads, head_dim, launch, backward)
    return atoms, tokens, head_dim, (triton.cdiv(atoms, constants["BLOCK"] // tokens),), constants


def _constants(tokens: int, heads: int, head_dim: int, launch: dict | None, backward: bool) -> dict:
    """The kernels' compile-time arguments for sequences of up to ``tokens`` (checked)."""
    if tokens > max_tokens(head_dim):
        raise ValueError(
            f"the attention kernels take at most {max_tokens(head_dim)} tokens with heads of {head_dim}, not {tokens}"
        )
    c = launch or config(tokens, head_dim, backward)
    columns = dict(DP=padded_columns(head_dim)) if backward else dict(zip(("DA", "DB"), head_columns(head_dim)))
    return dict(H=heads, D=head_dim, **columns, **c)


def forward(
    qkv: torch.Tensor, mask: torch.Tensor, heads: int, scale: float, launch: dict | None = None
) -> torch.Tensor:
    """``softmax(scale * q k^T + mask) v`` per atom and head: ``qkv`` [B, T, 3*H*D] and
    ``mask`` [B, T, T] float32, contiguous; returns [B, T, H*D] (heads side by side)."""
    atoms, tokens, head_dim, grid, constants = launch_shape(qkv, mask, heads, launch)
    out = qkv.new_empty(atoms, tokens, heads * head_dim)
    if atoms:
        with on_device(qkv.device):
            _attention_forward[grid](qkv, mask, out, atoms, tokens, scale, **constants)
    return out


def backward(
    grad_out: torch.Tensor, qkv: torch.Tensor, mask: torch.Tensor, heads: int, scale: float, launch: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`forward` with respect to ``qkv`` [B, T, 3*H*D] and ``mask``
    [B, T, T] (summed over the heads), for the output gradient ``grad_out`` [B, T, H*D]."""
    atoms, tokens, _, grid, constants = launch_shape(qkv, mask, heads, launch, backward=True)
    grad_qkv, grad_mask = torch.empty_like(qkv), torch.empty_like(mask)
    if atoms:
        with on_device(qkv.device):
            _attention_backward[grid](
                qkv, mask, grad_out.contiguous(), grad_qkv, grad_mask, atoms, tokens, scale, **constants
            )
    return grad_qkv, grad_mask


class Sequences(NamedTuple):
    """Where packed sequences lie (:func:`forward_packed`): atom a's sequence is its center
    token (row a of the nodes' tensors) and its ``counts[a]`` neighbor tokens, edge rows
    ``first[a] .. first[a] + counts[a] - 1``; the edge rows from ``total`` on hold no token."""

    first: torch.Tensor  # [N] int64
    counts: torch.Tensor  # [N] int64
    total: torch.Tensor  # 0-d int64: the edge rows in use
    tokens: int  # the longest sequence the kernels take: counts <= tokens - 1 (longer ones are cut)


FIT_CHUNK = 128
"""Atoms per program of :func:`fit_blocks`'s next-fit (each chunk starts a fresh block)."""


class Blocks(NamedTuple):
    """The packed kernels' blocks (:func:`fit_blocks`): block i holds the sequences of atoms
    ``order[p .. p + n - 1]`` one after the other, (p, n) = ``table[i]`` (n = 0: no block)."""

    order: torch.Tensor  # [N] int64: the atoms, in the blocks' order
    table: torch.Tensor  # [slots, 2] int64: each block's first position in order, its atoms


def fit_blocks(sequences: Sequences, block: int) -> Blocks:
    """The blocks of ``block`` token rows that the packed kernels tile ``sequences`` into,
    made on the device in one launch (no host synchronisation: CUDA graphs replay it). A
    block's cost hardly depends on how many sequences it holds (one ``block x block``
    product per head either way), so fewer blocks are the gain.

    Per chunk of :data:`FIT_CHUNK` consecutive atoms (their rows stay near each other), the
    atoms are ordered so that the most sequences longer than half a block come right after
    a short one they fit with (the m shortest short ones with the m shortest long ones,
    shortest with longest, for the largest m for which every pair fits: no matching of
    such pairs is larger), then the other short ones, then the other long ones, each by
    length; next-fit cuts that order into blocks (a block takes the next sequence while it
    fits). Each chunk's blocks hold at least ``block // tokens`` sequences, so the slots
    (:func:`_slots`) depend only on the atoms' number. PET-S's water sequences (25-41
    tokens) fill 64-row blocks ~1.6 at a time (1.35 in the atoms' order)."""
    atoms, chunks = sequences.counts.shape[0], triton.cdiv(sequences.counts.shape[0], FIT_CHUNK)
    slots = _slots(atoms, sequences.tokens, block)
    order, table = sequences.counts.new_empty(atoms), sequences.counts.new_empty(chunks * slots, 2)
    if chunks:
        with on_device(order.device):
            _fit_blocks[(chunks,)](
                sequences.counts,
                order,
                table,
                atoms,
                sequences.tokens,
                slots,
                CHUNK=FIT_CHUNK,
                BLOCK=block,
                num_warps=4,
            )
    return Blocks(order, table)


def _slots(atoms: int, tokens: int, block: int) -> int:
    """Block slots per chunk of :func:`fit_blocks` for ``atoms`` sequences of up to ``tokens``."""
    return triton.cdiv(min(FIT_CHUNK, atoms), block // tokens)


def packed_blocks(sequences: Sequences, heads: int, head_dim: int, launch: dict | None = None) -> Blocks:
    """:func:`fit_blocks` for the packed kernels' launch (``launch``, default :func:`config`)
    on heads of ``head_dim``: one tiling for a forward and its backward."""
    return fit_blocks(sequences, _constants(sequences.tokens, heads, head_dim, launch, False)["BLOCK"])


INTERPRETED_MULTIPROCESSORS = 132
"""The multiprocessors :func:`head_groups` counts for CPU tensors (Triton's interpreter): an H200's."""


def head_groups(slots: int, heads: int, device: torch.device, padded_backward: bool = False) -> int:
    """The groups of heads into which the packed kernels split their ``heads`` on ``device``
    for ``slots`` block slots: one program per slot and group, each taking ``heads // groups``
    heads one after the other. One group (each program all heads) while the slots give every
    multiprocessor two programs: the large systems' launch. Fewer slots are latency-bound
    (each program walks its heads one after another), and take the fewest groups, a divisor
    of ``heads``, that give every multiprocessor two programs (at most ``heads`` groups).
    Measured on the H200 (8 heads of 32, 25-41 tokens, in a CUDA graph): 192 atoms (256
    slots, 2 groups) forward 41 -> 23 us, backward 109 -> 63 us; 48 atoms (8 groups) 32 -> 11
    and 77 -> 18 us; at 384 atoms and from 1152 on, one group is the fastest or within 3%.
    A ``padded_backward`` (heads read in more columns than they have, PET-M's 48 in 64:
    :func:`padded_columns`) takes one head per program at every size: the walk over the
    heads spills more there than the extra programs cost (PET-M, 8 heads, H200: 17,280 atoms
    10.7 -> 8.8 ms, 2,304 atoms 1.55 -> 1.19 ms)."""
    if padded_backward:
        return heads
    wanted = 2 * (sm_count(device) if device.type == "cuda" else INTERPRETED_MULTIPROCESSORS)
    return next(g for g in range(1, heads + 1) if heads % g == 0 and (slots * g >= wanted or g == heads))


def _packed_launch(
    qkv: torch.Tensor,
    node_qkv: torch.Tensor,
    bias: torch.Tensor,
    sequences: Sequences,
    heads: int,
    launch: dict | None,
    backward: bool,
    blocks: Blocks | None,
    groups: int | None,
) -> tuple:
    """``(head_dim, grid, constants, blocks)`` of a packed launch (shapes checked first;
    ``blocks`` fitted when not given) whose programs take ``groups`` groups of the heads
    (default :func:`head_groups`; ``constants["HEADS"]``: the heads of a group)."""
    edges, width = qkv.shape
    atoms = node_qkv.shape[0]
    if (
        width % (3 * heads)
        or node_qkv.shape[1] != width
        or bias.shape != (edges,)
        or sequences.first.shape != (atoms,)
        or sequences.counts.shape != (atoms,)
    ):
        raise ValueError(
            f"qkv [E, 3*H*D], node qkv [N, 3*H*D], bias [E], first and counts [N] expected, got "
            f"{tuple(qkv.shape)}, {tuple(node_qkv.shape)}, {tuple(bias.shape)}, "
            f"{tuple(sequences.first.shape)}, {tuple(sequences.counts.shape)}"
        )
    if groups is not None and (groups < 1 or heads % groups):
        raise ValueError(f"the heads split into groups that divide them: {groups} groups of {heads} heads asked for")
    head_dim = width // (3 * heads)
    c = _constants(sequences.tokens, heads, head_dim, launch, backward)
    slots = triton.cdiv(atoms, FIT_CHUNK) * _slots(atoms, sequences.tokens, c["BLOCK"])
    if blocks is None:
        blocks = fit_blocks(sequences, c["BLOCK"])
    elif blocks.table.shape != (slots, 2) or blocks.order.shape != (atoms,):
        raise ValueError(
            f"blocks of {c['BLOCK']} rows: order [{atoms}] and table [{slots}, 2] expected, got "
            f"{tuple(blocks.order.shape)} and {tuple(blocks.table.shape)}"
        )
    padded = backward and padded_columns(head_dim) != head_dim
    groups = groups or head_groups(slots, heads, qkv.device, padded)
    return head_dim, (slots * groups + triton.cdiv(edges, c["BLOCK"]),), dict(c, HEADS=heads // groups), blocks


def forward_packed(
    qkv: torch.Tensor,
    node_qkv: torch.Tensor,
    bias: torch.Tensor,
    sequences: Sequences,
    heads: int,
    scale: float,
    launch: dict | None = None,
    blocks: Blocks | None = None,
    groups: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward` on sequences of different lengths, stored without padding: the
    queries, keys and values of the edge tokens ``qkv`` [E, 3*H*D] and of the atoms' center
    tokens ``node_qkv`` [N, 3*H*D], a bias [E] per edge token as key (0 for the center
    tokens; -inf drops a key), all float32 and contiguous, and the sequences' rows
    ``sequences``. Returns the outputs of the edge tokens [E, H*D] (zero in the rows from
    ``sequences.total`` on) and of the center tokens [N, H*D]. The kernels' blocks are
    ``blocks`` (:func:`packed_blocks`, fitted here when not given), whole sequences one after
    the other (the mask of atom a's scores: ``bias`` of its real tokens, -inf elsewhere), each
    block's heads split into ``groups`` programs (default :func:`head_groups`; the outputs do
    not depend on it)."""
    head_dim, grid, constants, blocks = _packed_launch(
        qkv, node_qkv, bias, sequences, heads, launch, False, blocks, groups
    )
    out, node_out = qkv.new_empty(qkv.shape[0], heads * head_dim), qkv.new_empty(node_qkv.shape[0], heads * head_dim)
    with on_device(qkv.device):
        _packed_forward[grid](
            qkv,
            node_qkv,
            bias,
            sequences.first,
            sequences.counts,
            *blocks,
            sequences.total,
            out,
            node_out,
            blocks.table.shape[0],
            sequences.tokens,
            qkv.shape[0],
            scale,
            **constants,
        )
    return out, node_out


def backward_packed(
    grad_out: torch.Tensor,
    node_grad_out: torch.Tensor,
    qkv: torch.Tensor,
    node_qkv: torch.Tensor,
    bias: torch.Tensor,
    sequences: Sequences,
    heads: int,
    scale: float,
    launch: dict | None = None,
    blocks: Blocks | None = None,
    groups: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`forward_packed` with respect to ``qkv``, ``node_qkv`` and ``bias``
    (zero in the edge rows from ``sequences.total`` on), for the output gradients
    ``grad_out`` [E, H*D] and ``node_grad_out`` [N, H*D], each block's heads split into
    ``groups`` programs (default :func:`head_groups`). The bias gradient sums the heads'
    gradients without atomics (the same bits on every run): in one group, the heads one
    after the other in the program; in more, each group's program sums its heads so into its
    column of a [E, groups] float32 tensor whose rows torch then sums. The gradients of
    ``qkv`` and ``node_qkv`` do not depend on the groups, the bias gradient only through that
    order of the heads' sums (a few float32 roundings)."""
    _, grid, constants, blocks = _packed_launch(qkv, node_qkv, bias, sequences, heads, launch, True, blocks, groups)
    groups = heads // constants["HEADS"]
    grad_qkv, node_grad_qkv = torch.empty_like(qkv), torch.empty_like(node_qkv)
    grad_bias = torch.empty_like(bias) if groups == 1 else bias.new_empty(bias.shape[0], groups)
    with on_device(qkv.device):
        _packed_backward[grid](
            qkv,
            node_qkv,
            bias,
            sequences.first,
            sequences.counts,
            *blocks,
            sequences.total,
            grad_out.contiguous(),
            node_grad_out.contiguous(),
            grad_qkv,
            node_grad_qkv,
            grad_bias,
            blocks.table.shape[0],
            sequences.tokens,
            qkv.shape[0],
            scale,
            **constants,
        )
    return grad_qkv, node_grad_qkv, grad_bias if groups == 1 else grad_bias.sum(1)
