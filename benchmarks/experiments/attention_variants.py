"""Two lighter attention layouts against the package's kernels (``kernels/attention.py``).

    python benchmarks/experiments/attention_variants.py --compile-only   # offline sm_90: registers, spills
    python benchmarks/experiments/attention_variants.py [--out F.json]  # H200: times and agreement

The package's kernels take one 64-row block per program and loop over the 8 heads, the
next head's loads in flight; the backward holds P, dP, dS and the head-summed mask
gradient at once and spills at 255 registers (``docs/design.md``).

- **split**: the backward in two kernels, A computing dQ and the mask gradient, B dK and
  dV; each recomputes P and dP (21 TF32x3 products against 15, Q/K/V/dO read twice) with
  about half the live tiles.
- **padded** (PET-M): the package's forward with a head of 48 padded to 64 columns, as
  before its heads were read in two power-of-two chunks (32 + 16). The backward read in
  chunks lost (19.38 ms against 18.74 padded) and stays padded.
- **per head**: one program per (block, head), no loop and no loop-carried mask gradient
  (offsets from a per-block base in int32); the backward writes each head's mask gradient
  [H, B, T, T] and torch sums them. Forward 199 registers and no spills, backward 100 bytes
  of spills (fused: 1,144).

Times: PET-S and PET-M shapes at 17,280 atoms (and PET-S at 192), every kernel in the same
run; the variants' results must agree with the package's to FP32 rounding.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

from ase_tcfp32._kernels import attention as fused
from ase_tcfp32._kernels.attention import _columns, _dot3, _dot3_exact_b, _head, _program_block, _softmax


@triton.jit
def _probabilities(q, k, bias, scale):
    return _softmax(_dot3(q, tl.trans(k)) * scale + bias)


@triton.jit
def _scores_gradient(p, do, v):
    dp = _dot3(do, tl.trans(v))
    return p * (dp - tl.sum(p * dp, 1)[:, None])


@triton.jit(do_not_specialize=["B", "T"])
def _backward_dq(
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
    x, io = _columns(row, real, 0, 3 * C, D, DP)  # one chunk, padded (the package's layout when measured)
    o, _ = _columns(row, real, 0, C, D, DP)
    grad_bias = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for h in tl.range(0, H, num_stages=STAGES):
        q, k, v = _head(qkv_ptr, x, io, h, C, D)
        do = tl.load(grad_out_ptr + h * D + o, mask=io, other=0.0)
        ds = _scores_gradient(_probabilities(q, k, bias, scale), do, v)
        grad_bias += ds
        tl.store(grad_qkv_ptr + h * D + x, _dot3(ds * scale, k), mask=io)
    tl.store(grad_mask_ptr + offsets, grad_bias, mask=same)


@triton.jit(do_not_specialize=["B", "T"])
def _backward_dkdv(
    qkv_ptr,
    mask_ptr,
    grad_out_ptr,
    grad_qkv_ptr,
    B,
    T,
    scale,
    H: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    row, real, bias, _, _ = _program_block(mask_ptr, B, T, BLOCK)
    C: tl.constexpr = H * D
    x, io = _columns(row, real, 0, 3 * C, D, DP)
    o, _ = _columns(row, real, 0, C, D, DP)
    for h in tl.range(0, H, num_stages=STAGES):
        q, k, v = _head(qkv_ptr, x, io, h, C, D)
        do = tl.load(grad_out_ptr + h * D + o, mask=io, other=0.0)
        p = _probabilities(q, k, bias, scale)
        tl.store(grad_qkv_ptr + h * D + 2 * C + x, _dot3(tl.trans(p), do), mask=io)
        ds = _scores_gradient(p, do, v)
        tl.store(grad_qkv_ptr + h * D + C + x, _dot3(tl.trans(ds * scale), q), mask=io)


@triton.jit
def _head_block(B, T, H: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    blk = pid // H
    h = pid - blk * H
    pack = BLOCK // T
    r = tl.arange(0, BLOCK)
    seq = r // T
    tok = r - seq * T
    atom0 = blk.to(tl.int64) * pack
    real = (seq < pack) & (atom0 + seq < B)
    return h, r, seq, tok, atom0, real


@triton.jit
def _block_bias(mask_ptr, atom0, seq, tok, real, T):
    TT = T * T
    same = (seq[:, None] == seq[None, :]) & real[:, None] & real[None, :]
    bias = tl.load(
        mask_ptr + atom0 * TT + (seq[:, None] * TT + tok[:, None] * T + tok[None, :]), mask=same, other=float("-inf")
    )
    return tl.where(real[:, None], bias, 0.0)


@triton.jit(do_not_specialize=["B", "T"])
def _forward_per_head(
    qkv_ptr, mask_ptr, out_ptr, B, T, scale, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr
):
    h, r, seq, tok, atom0, real = _head_block(B, T, H, BLOCK)
    C: tl.constexpr = H * D
    bias = _block_bias(mask_ptr, atom0, seq, tok, real, T)
    d = tl.arange(0, DP)
    io = real[:, None] & (d < D)[None, :]
    rowbase = atom0 * T
    base = qkv_ptr + rowbase * (3 * C) + h * D
    ioff = r[:, None] * (3 * C) + d[None, :]
    q = tl.load(base + ioff, mask=io, other=0.0)
    k = tl.load(base + C + ioff, mask=io, other=0.0)
    v = tl.load(base + 2 * C + ioff, mask=io, other=0.0)
    p = _probabilities(q, k, bias, scale)
    tl.store(out_ptr + rowbase * C + h * D + (r[:, None] * C + d[None, :]), _dot3_exact_b(p, v), mask=io)


@triton.jit(do_not_specialize=["B", "T"])
def _backward_per_head(
    qkv_ptr,
    mask_ptr,
    grad_out_ptr,
    grad_qkv_ptr,
    parts_ptr,
    B,
    T,
    scale,
    H: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    h, r, seq, tok, atom0, real = _head_block(B, T, H, BLOCK)
    C: tl.constexpr = H * D
    TT = T * T
    bias = _block_bias(mask_ptr, atom0, seq, tok, real, T)
    d = tl.arange(0, DP)
    io = real[:, None] & (d < D)[None, :]
    rowbase = atom0 * T
    base = qkv_ptr + rowbase * (3 * C) + h * D
    ioff = r[:, None] * (3 * C) + d[None, :]
    q = tl.load(base + ioff, mask=io, other=0.0)
    k = tl.load(base + C + ioff, mask=io, other=0.0)
    v = tl.load(base + 2 * C + ioff, mask=io, other=0.0)
    do = tl.load(grad_out_ptr + rowbase * C + h * D + (r[:, None] * C + d[None, :]), mask=io, other=0.0)
    p = _probabilities(q, k, bias, scale)
    gbase = grad_qkv_ptr + rowbase * (3 * C) + h * D
    tl.store(gbase + 2 * C + (r[:, None] * (3 * C) + d[None, :]), _dot3(tl.trans(p), do), mask=io)
    ds = _scores_gradient(p, do, v)
    same = (seq[:, None] == seq[None, :]) & real[:, None] & real[None, :]
    tl.store(
        parts_ptr + h.to(tl.int64) * B * TT + atom0 * TT + (seq[:, None] * TT + tok[:, None] * T + tok[None, :]),
        ds,
        mask=same,
    )
    ds = ds * scale
    tl.store(gbase + (r[:, None] * (3 * C) + d[None, :]), _dot3(ds, k), mask=io)
    tl.store(gbase + C + (r[:, None] * (3 * C) + d[None, :]), _dot3(tl.trans(ds), q), mask=io)


def per_head_forward(qkv, mask, heads, scale):
    atoms, tokens, width = qkv.shape
    head_dim = width // (3 * heads)
    out = qkv.new_empty(atoms, tokens, heads * head_dim)
    _forward_per_head[(triton.cdiv(atoms, 64 // tokens) * heads,)](
        qkv,
        mask,
        out,
        atoms,
        tokens,
        scale,
        H=heads,
        D=head_dim,
        DP=fused.padded_columns(head_dim),
        BLOCK=64,
        num_warps=4,
    )
    return out


def per_head_backward(grad_out, qkv, mask, heads, scale):
    atoms, tokens, width = qkv.shape
    head_dim = width // (3 * heads)
    grad_qkv, parts = torch.empty_like(qkv), qkv.new_empty(heads, *mask.shape)
    _backward_per_head[(triton.cdiv(atoms, 64 // tokens) * heads,)](
        qkv,
        mask,
        grad_out,
        grad_qkv,
        parts,
        atoms,
        tokens,
        scale,
        H=heads,
        D=head_dim,
        DP=fused.padded_columns(head_dim),
        BLOCK=64,
        num_warps=4,
    )
    return grad_qkv, parts.sum(0)


def padded_forward(qkv, mask, heads, scale):
    """The package's forward with the head read as one chunk padded to a power of two."""
    atoms, tokens, head_dim, grid, constants = fused.launch_shape(qkv, mask, heads)
    out = qkv.new_empty(atoms, tokens, qkv.shape[2] // 3)
    constants.update(DA=fused.padded_columns(head_dim), DB=0)
    fused._attention_forward[grid](qkv, mask, out, atoms, tokens, scale, **constants)
    return out


def split_backward(grad_out, qkv, mask, heads, scale, launch):
    atoms, tokens, head_dim, grid, constants = fused.launch_shape(qkv, mask, heads, launch)
    constants = dict(
        H=heads,
        D=head_dim,
        DP=fused.padded_columns(head_dim),
        BLOCK=constants["BLOCK"],
        STAGES=constants["STAGES"],
        num_warps=constants["num_warps"],
    )
    grad_qkv, grad_mask = torch.empty_like(qkv), torch.empty_like(mask)
    _backward_dq[grid](qkv, mask, grad_out, grad_qkv, grad_mask, atoms, tokens, scale, **constants)
    _backward_dkdv[grid](qkv, mask, grad_out, grad_qkv, atoms, tokens, scale, **constants)
    return grad_qkv, grad_mask


def compile_only() -> None:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from compile_sm90 import TARGET, structure
    from triton.compiler import ASTSource

    common = {"qkv_ptr": "*fp32", "mask_ptr": "*fp32", "grad_out_ptr": "*fp32", "grad_qkv_ptr": "*fp32"}
    scalars = {"B": "i32", "T": "i32", "scale": "fp32"}
    tail = {**scalars, **{k: "constexpr" for k in ("H", "D", "DP", "BLOCK", "STAGES")}}
    per_head = {**scalars, **{k: "constexpr" for k in ("H", "D", "DP", "BLOCK")}}
    package = {**scalars, **{k: "constexpr" for k in ("H", "D", "DA", "DB", "BLOCK", "STAGES")}}
    kernels = [
        (
            "package, forward",
            fused._attention_forward,
            {"qkv_ptr": "*fp32", "mask_ptr": "*fp32", "out_ptr": "*fp32", **package},
            True,
        ),
        ("package", fused._attention_backward, {**common, "grad_mask_ptr": "*fp32", **tail}, True),
        ("split dQ", _backward_dq, {**common, "grad_mask_ptr": "*fp32", **tail}, True),
        ("split dK dV", _backward_dkdv, {**common, **tail}, True),
        ("per head, backward", _backward_per_head, {**common, "parts_ptr": "*fp32", **per_head}, False),
        (
            "per head, forward",
            _forward_per_head,
            {"qkv_ptr": "*fp32", "mask_ptr": "*fp32", "out_ptr": "*fp32", **per_head},
            False,
        ),
    ]
    for head_dim in (32, 48):
        for name, kernel, signature, looped in kernels:
            launch = fused.config(40, head_dim, backward=kernel is not fused._attention_forward)
            constants = dict(H=8, D=head_dim, BLOCK=launch["BLOCK"])
            constants.update(STAGES=launch["STAGES"]) if looped else None
            first, rest = fused.head_columns(head_dim)
            constants.update(DA=first, DB=rest) if kernel is fused._attention_forward else constants.update(
                DP=fused.padded_columns(head_dim)
            )
            compiled = triton.compile(
                ASTSource(kernel, signature, constexprs=constants),
                target=TARGET,
                options=dict(num_warps=launch["num_warps"]),
            )
            print(f"heads of {head_dim}, {name}: {structure(compiled)}")


def measure(out: str | None) -> None:
    from triton.testing import do_bench

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from attention import HEADS, inputs, sdpa

    from ase_tcfp32.validation.common import environment

    rows = []
    for size, atoms in (("s", 17280), ("m", 17280), ("s", 192)):
        qkv, mask, scale = inputs(size, atoms)
        grad = torch.randn(*qkv.shape[:2], qkv.shape[2] // 3, device="cuda")
        launch = fused.config(qkv.shape[1], qkv.shape[2] // (3 * HEADS), backward=True)
        expected = fused.forward(qkv, mask, HEADS, scale), *fused.backward(grad, qkv, mask, HEADS, scale)
        time = lambda f: do_bench(f, warmup=25, rep=200)  # noqa: E731
        row = {
            "model": size,
            "atoms": atoms,
            "tokens": qkv.shape[1],
            "sdpa_fwd_ms": time(lambda: sdpa(qkv, mask, scale)),
            "fused_fwd_ms": time(lambda: fused.forward(qkv, mask, HEADS, scale)),
            "fused_bwd_ms": time(lambda: fused.backward(grad, qkv, mask, HEADS, scale)),
            "split_bwd_ms": time(lambda: split_backward(grad, qkv, mask, HEADS, scale, launch)),
            "per_head_fwd_ms": time(lambda: per_head_forward(qkv, mask, HEADS, scale)),
            "per_head_bwd_ms": time(lambda: per_head_backward(grad, qkv, mask, HEADS, scale)),
            "padded_fwd_ms": time(lambda: padded_forward(qkv, mask, HEADS, scale)),
        }
        for name, found in (
            ("padded", (padded_forward(qkv, mask, HEADS, scale), *expected[1:])),
            ("split", (expected[0], *split_backward(grad, qkv, mask, HEADS, scale, launch))),
            (
                "per_head",
                (per_head_forward(qkv, mask, HEADS, scale), *per_head_backward(grad, qkv, mask, HEADS, scale)),
            ),
        ):
            # relative differences from the package's output, dqkv and dmask
            row[f"{name}_difference"] = [((a - b).norm() / b.norm()).item() for a, b in zip(found, expected)]
        print(json.dumps(row), flush=True)
        rows.append(row)
        if out:
            with open(out, "w") as f:
                json.dump({"environment": environment("cuda"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--compile-only", action="store_true", help="offline sm_90 compile: registers, spills, shared memory"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    compile_only() if args.compile_only else measure(args.out)
