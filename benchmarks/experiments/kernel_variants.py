"""TF32x3 kernel experiments on the large PET-S shapes (what each lever buys, measured).

Each variant is the production kernel's arithmetic (per-K-tile fresh accumulator for the
small terms, FP32 running sum) with one structural change; every variant is timed against
cuBLAS FP32 in the same run and its error vs FP64 printed, so that a faster variant that
loses accuracy shows up. Its findings are in ``docs/design.md``.

    python benchmarks/experiments/kernel_variants.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ase_tcfp32._kernels.split import round_tf32
from ase_tcfp32._kernels.triton_gemm import _round_tf32, _split_tf32


@triton.jit
def _split_exact(a):
    hi = _round_tf32(a)
    finite = tl.abs(a) < float("inf")
    return hi, tl.where(finite, a - hi, 0.0), tl.where(finite, hi, 0.0)


@triton.jit(do_not_specialize=["M"])
def _variant_kernel(
    x_ptr,
    x_desc,
    w_ptr,
    w2_ptr,
    whi_desc,
    wlo_desc,
    y_ptr,
    M,
    N,
    K,
    K2,
    stride_xm,
    stride_ym,
    CHEAP: tl.constexpr,
    CONCAT: tl.constexpr,
    LAG: tl.constexpr,
    TMA: tl.constexpr,
    SPLIT_ACC: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
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
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    prev = tl.zeros((BM, BN), dtype=tl.float32)
    small = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        if TMA:
            a = x_desc.load([pid_m * BM, k0])
            b_hi = whi_desc.load([pid_n * BN, k0]).T
        else:
            a = tl.load(
                x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0
            )
            b_hi = tl.load(w_ptr + rn[None, :] * K + kk[:, None], mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        if CHEAP:
            hi, lo, hic = _split_tf32(a)  # the production split
        else:
            hi, lo, hic = _split_exact(a)
        if SPLIT_ACC:  # hi*hi per tile (FP32 running sum); corrections in their own TC accumulator
            tile = tl.dot(hi, b_hi, input_precision="tf32")
        else:
            small = tl.zeros((BM, BN), dtype=tl.float32)
        if CONCAT:
            kk2 = 2 * k0 + tl.arange(0, 2 * BK)
            b2 = tl.load(w2_ptr + rn[None, :] * K2 + kk2[:, None], mask=rn[None, :] < N, other=0.0)
            a2 = tl.reshape(tl.permute(tl.join(lo, hic), (0, 2, 1)), (BM, 2 * BK))
            small = tl.dot(a2, b2, small, input_precision="tf32")
        else:
            if TMA:
                b_lo = wlo_desc.load([pid_n * BN, k0]).T
            else:
                b_lo = tl.load(
                    w_ptr + N * K + rn[None, :] * K + kk[:, None], mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0
                )
            small = tl.dot(lo, b_hi, small, input_precision="tf32")
            small = tl.dot(hic, b_lo, small, input_precision="tf32")
        if not SPLIT_ACC:
            tile = tl.dot(hi, b_hi, small, input_precision="tf32")
        if LAG:
            acc += prev
            prev = tile
        else:
            acc += tile
    acc += prev
    if SPLIT_ACC:
        acc += small
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


VARIANTS = {  # name: (CHEAP, CONCAT, LAG, TMA, SPLIT_ACC, BK, num_stages)
    "current": (0, 0, 0, 0, 0, 32, 3),
    "cheap-split": (1, 0, 0, 0, 0, 32, 3),
    "concat-small": (1, 1, 0, 0, 0, 32, 3),
    "lagged-add": (1, 0, 1, 0, 0, 32, 3),
    "tma": (1, 0, 0, 1, 0, 32, 3),
    "tma-lag": (1, 0, 1, 1, 0, 32, 3),
    "bk64-s2": (1, 0, 0, 0, 0, 64, 2),
    "tma-bk64-s2": (1, 0, 0, 1, 0, 64, 2),
    "split-acc": (1, 0, 0, 0, 1, 32, 3),
    "tma-split-acc": (1, 0, 0, 1, 1, 32, 3),
    "tma-split-acc-concat": (1, 1, 0, 1, 1, 32, 3),
    "tma-split-acc-bk64": (1, 0, 0, 1, 1, 64, 2),
    "tma-split-acc-lag": (1, 0, 1, 1, 1, 32, 3),
    "tma-split-acc-concat-lag": (1, 1, 1, 1, 1, 32, 3),
    "split-acc-concat-lag": (1, 1, 1, 0, 1, 32, 3),
}


def prepare(w: torch.Tensor, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Words [2, N, K] and the concatenated small-dot operand [N, 2 Kp] (tiles of bhi | blo)."""
    hi = round_tf32(w)
    words = torch.stack([hi, w - hi]).contiguous()
    n, k = w.shape
    kp = triton.cdiv(k, bk) * bk
    padded = torch.zeros(2, n, kp, device=w.device)
    padded[:, :, :k] = words
    w2 = padded.view(2, n, kp // bk, bk).permute(1, 2, 0, 3).reshape(n, 2 * kp).contiguous()
    return words, w2


def run(x, words, w2, variant):
    cheap, concat, lag, tma, split_acc, bk, stages = VARIANTS[variant]
    m, k = x.shape
    n = words.shape[1]
    y = torch.empty(m, n, device=x.device)
    bm, bn = 128, min(128, triton.next_power_of_2(n))
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk]) if tma else None
    whi = TensorDescriptor.from_tensor(words[0], [bn, bk]) if tma else None
    wlo = TensorDescriptor.from_tensor(words[1], [bn, bk]) if tma else None
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _variant_kernel[grid](
        x,
        x_desc,
        words,
        w2,
        whi,
        wlo,
        y,
        m,
        n,
        k,
        w2.shape[1],
        x.stride(0),
        y.stride(0),
        CHEAP=cheap,
        CONCAT=concat,
        LAG=lag,
        TMA=tma,
        SPLIT_ACC=split_acc,
        BM=bm,
        BN=bn,
        BK=bk,
        GROUP_M=8,
        num_warps=8,
        num_stages=stages,
    )
    return y


def bench(fn, reps=20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


SHAPES = [  # large PET-S at 17,280 water atoms: (M, K, N), forward and backward
    (673920, 768, 256),
    (673920, 256, 768),
    (673920, 256, 256),
    (691200, 256, 768),
    (691200, 768, 256),
    (691200, 256, 256),
    (673920, 256, 1024),
    (673920, 1024, 256),
    (673920, 512, 256),
    (673920, 256, 512),
    (673920, 512, 512),
    (17280, 1024, 4096),
    (17280, 4096, 1024),
    (17280, 2048, 1024),
    (17280, 1024, 2048),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    names = args.variants.split(",")
    torch.manual_seed(0)
    rows = []
    print(f"{'M x K x N':>22} {'fp32 ms':>8} " + " ".join(f"{n:>13}" for n in names))
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device="cuda")
        w = torch.randn(n, k, device="cuda") / k**0.5
        ref = x[:4096].double() @ w.double().T
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        fp32 = bench(lambda: x @ w.T)
        err32 = float((x[:4096] @ w.T - ref).norm() / ref.norm())
        row = dict(shape=[m, k, n], fp32_ms=fp32, fp32_err=err32)
        cells = []
        for name in names:
            words, w2 = prepare(w, VARIANTS[name][5])
            try:
                t = bench(lambda: run(x, words, w2, name))
                err = float((run(x[:4096].contiguous(), words, w2, name) - ref).norm() / ref.norm())
                row[name] = dict(ms=t, speedup=fp32 / t, err_vs_fp32=err / err32)
                cells.append(f"{fp32 / t:5.2f}x e{err / err32:4.2f}")
            except Exception as exc:  # a variant that does not compile for this shape
                row[name] = dict(error=f"{type(exc).__name__}: {str(exc)[:200]}")
                cells.append(f"{type(exc).__name__[:13]:>13}")
        rows.append(row)
        print(f"{m:>8}x{k:>5}x{n:>5} {fp32:8.3f} " + " ".join(f"{c:>13}" for c in cells), flush=True)
    if args.json:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
        json.dump(dict(meta=meta, rows=rows), open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
