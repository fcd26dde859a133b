"""The attention backward split in two kernels, against the package's fused one.

    python benchmarks/experiments/attention_variants.py --compile-only   # offline sm_90: registers, spills
    python benchmarks/experiments/attention_variants.py                  # H200: times and agreement

The package's backward (``kernels/attention.py``) holds P, dP, dS and the head-summed mask
gradient at once and spills at 255 registers (kernel notes, session 12). Here kernel A
computes dQ and the mask gradient, kernel B dK and dV; each recomputes P and dP (21 TF32x3
products against 15, Q/K/V/dO read twice) with about half the live tiles. Times: PET-S and
PET-M shapes at 17,280 atoms, fused vs split, same run; the split's gradients must agree
with the fused ones to FP32 rounding.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from ase_tcfp32.kernels import attention as fused
from ase_tcfp32.kernels.attention import _dot3, _head, _probabilities, _program_block, _rows, _scores_gradient


@triton.jit(do_not_specialize=["B", "T"])
def _backward_dq(qkv_ptr, mask_ptr, grad_out_ptr, grad_qkv_ptr, grad_mask_ptr, B, T, scale,
                 H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    row, bias, offsets, same, d, io = _program_block(mask_ptr, B, T, D, DP, BLOCK)
    C: tl.constexpr = H * D
    inputs, grads = _rows(qkv_ptr, row, d, 3 * C), _rows(grad_qkv_ptr, row, d, 3 * C)
    grad_outputs = _rows(grad_out_ptr, row, d, C)
    grad_bias = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for h in tl.range(0, H, num_stages=STAGES):
        q, k, v = _head(inputs, h, C, D, io)
        do = tl.load(grad_outputs + h * D, mask=io, other=0.0)
        ds = _scores_gradient(_probabilities(q, k, bias, scale), do, v)
        grad_bias += ds
        tl.store(grads + h * D, _dot3(ds * scale, k), mask=io)
    tl.store(grad_mask_ptr + offsets, grad_bias, mask=same)


@triton.jit(do_not_specialize=["B", "T"])
def _backward_dkdv(qkv_ptr, mask_ptr, grad_out_ptr, grad_qkv_ptr, B, T, scale,
                   H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    row, bias, _, _, d, io = _program_block(mask_ptr, B, T, D, DP, BLOCK)
    C: tl.constexpr = H * D
    inputs, grads = _rows(qkv_ptr, row, d, 3 * C), _rows(grad_qkv_ptr, row, d, 3 * C)
    grad_outputs = _rows(grad_out_ptr, row, d, C)
    for h in tl.range(0, H, num_stages=STAGES):
        q, k, v = _head(inputs, h, C, D, io)
        do = tl.load(grad_outputs + h * D, mask=io, other=0.0)
        p = _probabilities(q, k, bias, scale)
        tl.store(grads + (2 * C + h * D), _dot3(tl.trans(p), do), mask=io)
        ds = _scores_gradient(p, do, v)
        tl.store(grads + (C + h * D), _dot3(tl.trans(ds * scale), q), mask=io)


def split_backward(grad_out, qkv, mask, heads, scale, launch):
    atoms, tokens, _, grid, constants = fused.launch_shape(qkv, mask, heads, launch)
    grad_qkv, grad_mask = torch.empty_like(qkv), torch.empty_like(mask)
    _backward_dq[grid](qkv, mask, grad_out, grad_qkv, grad_mask, atoms, tokens, scale, **constants)
    _backward_dkdv[grid](qkv, mask, grad_out, grad_qkv, atoms, tokens, scale, **constants)
    return grad_qkv, grad_mask


def compile_only() -> None:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from compile_sm90 import TARGET, structure
    from triton.compiler import ASTSource

    common = {"qkv_ptr": "*fp32", "mask_ptr": "*fp32", "grad_out_ptr": "*fp32", "grad_qkv_ptr": "*fp32"}
    tail = {"B": "i32", "T": "i32", "scale": "fp32", **{k: "constexpr" for k in ("H", "D", "DP", "BLOCK", "STAGES")}}
    kernels = [("fused", fused._attention_backward, {**common, "grad_mask_ptr": "*fp32", **tail}),
               ("split dQ", _backward_dq, {**common, "grad_mask_ptr": "*fp32", **tail}),
               ("split dK dV", _backward_dkdv, {**common, **tail})]  # fmt: skip
    for head_dim in (32, 48):
        launch = fused.config(40, head_dim, backward=True)
        for name, kernel, signature in kernels:
            constants = dict(H=8, D=head_dim, DP=triton.next_power_of_2(head_dim), BLOCK=launch["BLOCK"], STAGES=launch["STAGES"])
            compiled = triton.compile(ASTSource(kernel, signature, constexprs=constants), target=TARGET,
                                      options=dict(num_warps=launch["num_warps"]))  # fmt: skip
            print(f"heads of {head_dim}, {name}: {structure(compiled)}")


def measure() -> None:
    from triton.testing import do_bench

    for width, tokens in ((256, 40), (384, 52)):
        g = torch.Generator(device="cuda").manual_seed(0)
        qkv = torch.randn(17280, tokens, 3 * width, device="cuda", generator=g)
        mask = torch.log(torch.rand(17280, tokens, tokens, device="cuda", generator=g).clamp_min(1e-15))
        grad = torch.randn(17280, tokens, width, device="cuda", generator=g)
        scale, launch = (width // 8) ** -0.5, fused.config(tokens, width // 8, backward=True)
        expected = fused.backward(grad, qkv, mask, 8, scale)
        found = split_backward(grad, qkv, mask, 8, scale, launch)
        agree = max(((a - b).norm() / b.norm()).item() for a, b in zip(found, expected))
        ms_fused = do_bench(lambda: fused.backward(grad, qkv, mask, 8, scale))
        ms_split = do_bench(lambda: split_backward(grad, qkv, mask, 8, scale, launch))
        print(f"d_pet {width}, T = {tokens}: backward fused {ms_fused:.2f} ms, split {ms_split:.2f} ms "
              f"({ms_fused / ms_split:.2f}x), relative difference {agree:.1e}")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", help="offline sm_90 compile: registers, spills, shared memory")
    compile_only() if parser.parse_args().compile_only else measure()
