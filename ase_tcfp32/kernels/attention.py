"""FP32-accurate attention on tensor cores for PET's short sequences (Triton).

PET's transformer attends, for each of B atoms, over T = J + 1 tokens (the atom and its J
neighbour slots: ~25-50) in H heads of width D (PET-S 8 x 32, PET-M 8 x 48), with an
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
(``docs/kernel_notes.md``, session 12). The softmax and every sum are FP32 on CUDA cores.
On the H200: 2.2x torch's FP32 SDPA forward + backward at PET-S's shapes
(``benchmarks/attention.py``).

Layouts, as PET's projections read and write them (no transposed copies):
``qkv`` [B*T, 3*H*D] (query, key, value of head h at columns ``h*D``, ``C + h*D``,
``2C + h*D`` with C = H*D), ``out`` [B*T, C], ``mask`` [B, T, T]. The forward reads a
head whose width is not a power of two as two chunks that are (:func:`head_columns`:
PET-M's 48 = 32 + 16), each product of the head being the sum of the chunks' products;
the backward pads it with zero columns (:func:`padded_columns`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .context import on_device
from .triton_gemm import _round_tf32



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
def _columns(row, real, first: tl.constexpr, width: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """Offsets [BLOCK, DP] of the columns ``first .. first + DP - 1`` of the block's rows of a
    row-major [rows, width] tensor, and where they are real (``first + DP`` past ``D``: padding)."""
    d = tl.arange(0, DP)
    return row[:, None] * width + (first + d)[None, :], real[:, None] & (first + d < D)[None, :]


@triton.jit
def _head(qkv_ptr, offsets, io, h, C: tl.constexpr, D: tl.constexpr):
    """Head ``h``'s queries, keys and values at ``offsets`` of the head's columns in qkv
    [B*T, 3*C] (:func:`_columns`), zero outside ``io``."""
    inputs = qkv_ptr + h * D + offsets
    q = tl.load(inputs, mask=io, other=0.0)
    k = tl.load(inputs + C, mask=io, other=0.0)
    v = tl.load(inputs + 2 * C, mask=io, other=0.0)
    return q, k, v


@triton.jit
def _softmax(s):
    """Softmax by rows of the scores [BLOCK, BLOCK]."""
    p = tl.exp(s - tl.max(s, 1)[:, None])
    return p / tl.sum(p, 1)[:, None]


@triton.jit(do_not_specialize=["B", "T"])
def _attention_forward(qkv_ptr, mask_ptr, out_ptr, B, T, scale,
                       H: tl.constexpr, D: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, BLOCK: tl.constexpr,
                       STAGES: tl.constexpr):  # fmt: skip
    row, real, bias, _offsets, _same = _program_block(mask_ptr, B, T, BLOCK)
    C: tl.constexpr = H * D
    for h in tl.range(0, H, num_stages=STAGES):
        x_a, io_a = _columns(row, real, 0, 3 * C, D, DA)  # the head's first DA columns
        o_a = _columns(row, real, 0, C, D, DA)[0]
        q, k, v = _head(qkv_ptr, x_a, io_a, h, C, D)
        if DB > 0:  # and its last DB columns
            x_b, io_b = _columns(row, real, DA, 3 * C, D, DB)
            o_b = _columns(row, real, DA, C, D, DB)[0]
            q_b, k_b, v_b = _head(qkv_ptr, x_b, io_b, h, C, D)
            s = _dot3_chunks(q, tl.trans(k), q_b, tl.trans(k_b))
        else:
            s = _dot3(q, tl.trans(k))
        p = _softmax(s * scale + bias)
        tl.store(out_ptr + h * D + o_a, _dot3_exact_b(p, v), mask=io_a)
        if DB > 0:
            tl.store(out_ptr + h * D + o_b, _dot3_exact_b(p, v_b), mask=io_b)


@triton.jit(do_not_specialize=["B", "T"])
def _attention_backward(qkv_ptr, mask_ptr, grad_out_ptr, grad_qkv_ptr, grad_mask_ptr, B, T, scale,
                        H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
                        STAGES: tl.constexpr):  # fmt: skip
    row, real, bias, offsets, same = _program_block(mask_ptr, B, T, BLOCK)
    C: tl.constexpr = H * D
    grad_bias = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)  # summed over the heads
    for h in tl.range(0, H, num_stages=STAGES):
        x, io = _columns(row, real, 0, 3 * C, D, DP)  # the head's columns, padded to DP
        q, k, v = _head(qkv_ptr, x, io, h, C, D)
        do = tl.load(grad_out_ptr + h * D + _columns(row, real, 0, C, D, DP)[0], mask=io, other=0.0)
        p = _softmax(_dot3(q, tl.trans(k)) * scale + bias)
        grads = grad_qkv_ptr + h * D
        tl.store(grads + 2 * C + x, _dot3(tl.trans(p), do), mask=io)  # dV = P^T dO
        dp = _dot3(do, tl.trans(v))
        ds = p * (dp - tl.sum(p * dp, 1)[:, None])  # the gradient of the masked scores
        grad_bias += ds
        ds = ds * scale
        tl.store(grads + x, _dot3(ds, k), mask=io)  # dQ
        tl.store(grads + C + x, _dot3(tl.trans(ds), q), mask=io)  # dK
    tl.store(grad_mask_ptr + offsets, grad_bias, mask=same)


def padded_columns(head_dim: int) -> int:
    """The columns, a power of two, in which the backward kernel reads a head (zeros past
    ``head_dim``)."""
    return max(16, triton.next_power_of_2(head_dim))


def head_columns(head_dim: int) -> tuple[int, int]:
    """``(DA, DB)``: the forward kernel reads a head in two column chunks of powers of two,
    DA + DB = ``head_dim`` (DB >= 16; PET-M's 48 = 32 + 16), or in one of DA >= ``head_dim``
    columns (DB = 0), padded with zeros when ``head_dim`` is not a power of two (24 -> 32).
    Measured on the H200, PET-M at 17,280 atoms (``attention_variants_h200_session19.json``):
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
    (``benchmarks/attention.py``, ``attention_h200.json``): 64-row blocks with 4 warps beat
    128-row blocks of 3 packed sequences at PET-S's 40 tokens (2.2x against 1.1x SDPA
    forward + backward); a second pipeline stage over the heads helps every forward (PET-M,
    17,280 atoms: 5.8 against 7.4 ms) but only the backward of heads up to 32 wide (PET-M's
    backward: ~18.8 ms with one stage, ~26.1 with two)."""
    if tokens > 64:  # one to two sequences per block; the backward's shared memory allows one stage
        return dict(BLOCK=128, num_warps=8, STAGES=1)
    return dict(BLOCK=64, num_warps=4, STAGES=2 if head_dim <= 32 or not backward else 1)


def launch_shape(qkv: torch.Tensor, mask: torch.Tensor, heads: int, launch: dict | None = None,
                 backward: bool = False) -> tuple:  # fmt: skip
    """``(atoms, tokens, head_dim, grid, constants)`` of a launch on ``qkv`` [B, T, 3*H*D]
    and ``mask`` [B, T, T] (checked: a clear error before any launch), ``constants`` being
    the forward (or ``backward``) kernel's compile-time arguments with ``launch`` (default
    :func:`config`)."""
    atoms, tokens, width = qkv.shape
    if width % (3 * heads) or mask.shape != (atoms, tokens, tokens):
        raise ValueError(f"qkv [B, T, 3*H*D] and mask [B, T, T] expected, got {tuple(qkv.shape)} and {tuple(mask.shape)}")
    head_dim = width // (3 * heads)
    if tokens > max_tokens(head_dim):
        raise ValueError(f"the attention kernels take at most {max_tokens(head_dim)} tokens with heads of {head_dim}, not {tokens}")
    c = launch or config(tokens, head_dim, backward)
    grid = (triton.cdiv(atoms, c["BLOCK"] // tokens),)
    columns = dict(DP=padded_columns(head_dim)) if backward else dict(zip(("DA", "DB"), head_columns(head_dim)))
    return atoms, tokens, head_dim, grid, dict(H=heads, D=head_dim, **columns, **c)


def forward(qkv: torch.Tensor, mask: torch.Tensor, heads: int, scale: float, launch: dict | None = None) -> torch.Tensor:
    """``softmax(scale * q k^T + mask) v`` per atom and head: ``qkv`` [B, T, 3*H*D] and
    ``mask`` [B, T, T] float32, contiguous; returns [B, T, H*D] (heads side by side)."""
    atoms, tokens, head_dim, grid, constants = launch_shape(qkv, mask, heads, launch)
    out = qkv.new_empty(atoms, tokens, heads * head_dim)
    if atoms:
        with on_device(qkv.device):
            _attention_forward[grid](qkv, mask, out, atoms, tokens, scale, **constants)
    return out


def backward(grad_out: torch.Tensor, qkv: torch.Tensor, mask: torch.Tensor, heads: int, scale: float,
             launch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Gradients of :func:`forward` with respect to ``qkv`` [B, T, 3*H*D] and ``mask``
    [B, T, T] (summed over the heads), for the output gradient ``grad_out`` [B, T, H*D]."""
    atoms, tokens, _, grid, constants = launch_shape(qkv, mask, heads, launch, backward=True)
    grad_qkv, grad_mask = torch.empty_like(qkv), torch.empty_like(mask)
    if atoms:
        with on_device(qkv.device):
            _attention_backward[grid](qkv, mask, grad_out.contiguous(), grad_qkv, grad_mask, atoms, tokens, scale,
                                      **constants)  # fmt: skip
    return grad_qkv, grad_mask
