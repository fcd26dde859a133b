"""GEMM speed and accuracy on PET shapes: cuBLAS FP32 / TF32 against our kernels.

    python benchmarks/gemm.py [--models s,m] [--atoms 192,17280] [--kernels tf32,tf32x3,fp16x3,bf16x9]
                              [--out results.json]
    python benchmarks/gemm.py --markdown results.json    # the tables of docs/performance.md

For each Linear of PET-MAD-S / -M (shapes from the PET-MAD hyperparameters, M = atoms x
padded neighbors or atoms x (neighbors + 1), water at 1 g/cm³) it times the forward
y = x W^T + b and the force backward dX = dY W with cuBLAS FP32 (IEEE), cuBLAS TF32 and
each of our kernels (Triton; the Gluon fp16x3 kernel on Hopper), in the same run, and prints speed-ups against cuBLAS FP32 and relative
Frobenius errors against FP64 (first 16384 rows). Our backends send GEMMs too small to
fill the GPU to cuBLAS FP32, as the calculator does.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from ase_tcfp32._kernels.cublas import version as cublas_version
from ase_tcfp32._kernels.triton_gemm import TritonBackend
from ase_tcfp32.validation.common import environment as validation_environment

PAD_WIDTH = {("s", 192): 38, ("s", 17280): 39, ("m", 192): 49, ("m", 17280): 51}
"""Padded neighbor width W of water at 1 g/cm³ (cutoff_width_adaptive 1.0)."""


def pet_shapes(size: str, atoms: int) -> list[tuple[str, int, int, int]]:
    """(layer, M, K, N) of the distinct PET-MAD Linear shapes (d = d_pet, dn = 4d)."""
    d = {"s": 256, "m": 384}[size]
    dn = 4 * d
    w = PAD_WIDTH[(size, atoms)]
    edges, tokens = atoms * w, atoms * (w + 1)
    return [
        ("compress.0 (g>0)", edges, 3 * d, d),
        ("compress.2 / edge heads", edges, d, d),
        ("attention.input_linear", tokens, d, 3 * d),
        ("attention.output_linear", tokens, d, d),
        ("mlp.w_in", edges, d, 4 * d),
        ("mlp.w_out / comb.2", edges, 2 * d, d),
        ("combination_mlp.0", edges, 2 * d, 2 * d),
        ("center_mlp.w_in", atoms, dn, 4 * dn),
        ("center_mlp.w_out", atoms, 2 * dn, dn),
    ]


def rel_error(y: torch.Tensor, exact: torch.Tensor) -> float:
    return ((y.double() - exact).norm() / exact.norm()).item()


def bench_shape(m: int, k: int, n: int, backends: dict) -> dict:
    g = torch.Generator(device="cuda").manual_seed(m + k + n)
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
    b = torch.randn(n, device="cuda", generator=g)
    gy = torch.randn(m, n, device="cuda", generator=g)
    rows = slice(0, min(m, 16384))
    exact_y = x[rows].double() @ w.double().T + b.double()
    exact_dx = gy[rows].double() @ w.double()
    matmul = torch.backends.cuda.matmul
    out = {"M": m, "K": k, "N": n, "gflop": 2 * m * k * n / 1e9}
    for name, tf32 in [("cublas_fp32", "ieee"), ("cublas_tf32", "tf32")]:
        saved = matmul.fp32_precision
        matmul.fp32_precision = tf32
        try:
            fwd = do_bench(lambda: torch.addmm(b, x, w.T), return_mode="median")
            bwd = do_bench(lambda: gy @ w, return_mode="median")
            err_y = rel_error(torch.addmm(b, x[rows], w.T), exact_y)
            err_dx = rel_error(gy[rows] @ w, exact_dx)
        finally:
            matmul.fp32_precision = saved
        out[name] = {"fwd_ms": fwd, "bwd_ms": bwd, "err_fwd": err_y, "err_bwd": err_dx}
    for name, backend in backends.items():
        prepared = backend.prepare(w)
        fwd = do_bench(lambda: backend.forward(x, prepared, b), return_mode="median")
        bwd = do_bench(lambda: backend.grad_input(gy, prepared), return_mode="median")
        err_y = rel_error(backend.forward(x[rows].contiguous(), prepared, b), exact_y)
        err_dx = rel_error(backend.grad_input(gy[rows].contiguous(), prepared), exact_dx)
        out[name] = {"fwd_ms": fwd, "bwd_ms": bwd, "err_fwd": err_y, "err_bwd": err_dx}
    return out


def environment() -> dict:
    """The run's versions and GPU (:func:`ase_tcfp32.validation.common.environment`) and cuBLAS's version."""
    return {**validation_environment("cuda"), "cublas": cublas_version()}


def markdown(results: dict) -> str:
    """The speed-up and error table of a results JSON, as Markdown."""
    kernels = [k for k in results["shapes"][0] if k.startswith(METHODS)]
    lines = [
        "| model | atoms | layer | M x K x N | FP32 fwd ms | " + " | ".join(k.replace("_", " ") for k in kernels[1:]) + " |",
        "|---|---|---|---|---|" + "---|" * (len(kernels) - 1),
    ]
    for row in results["shapes"]:
        base = row["cublas_fp32"]
        cells = [
            f"{base['fwd_ms'] / row[k]['fwd_ms']:.2f} / {base['bwd_ms'] / row[k]['bwd_ms']:.2f}x, err {row[k]['err_fwd'] / base['err_fwd']:.2g}x"
            for k in kernels[1:]
        ]
        lines.append(
            f"| {row['model']} | {row['atoms']} | {row['layer']} | {row['M']}x{row['K']}x{row['N']} | "
            f"{base['fwd_ms']:.3f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


METHODS = ("cublas", "triton", "gluon")
"""Prefixes of the methods' keys in a results row."""

PEAKS = {"H100": (494.7, 3.35), "H200": (494.7, 4.3), "A100": (156.0, 1.6)}
"""Dense TF32 tensor-core TFLOP/s and memory bandwidth (TB/s; H200: measured copy rate)."""

BOUND = {"tf32": 1, "tf32x3": 1 / 3, "fp16x3": 2 / 3, "bf16x9": 2 / 9}
"""Each emulation's FP32-equivalent tensor-core bound as a multiple of the dense TF32
peak (FP16 and BF16 tensor cores run at twice the TF32 rate)."""


def roofline(results: dict, min_rows: int = 100_000) -> str:
    """Forward TFLOP/s of every method on the large shapes, each of our kernels' share of
    its tensor-core bound (:data:`BOUND`), and the memory floor (read x and the weight's
    words, write y once), as Markdown."""
    peak = next((v for name, v in PEAKS.items() if name in results["environment"]["gpu"]), None)
    kernels = [k for k in results["shapes"][0] if k.startswith(METHODS)]
    ours = [k for k in kernels if not k.startswith("cublas")]
    lines = ["| shape (M x K x N) | " + " | ".join(f"{k.replace('_', ' ')} TFLOP/s" for k in kernels)
             + "".join(f" | {k.split('_')[-1]} / bound" for k in ours) + " | memory floor ms |",
             "|---|" + "---|" * (len(kernels) + len(ours) + 1)]  # fmt: skip
    for row in results["shapes"]:
        if row["M"] < min_rows:
            continue
        m, k, n = row["M"], row["K"], row["N"]
        tflops = {name: 2 * m * k * n / (row[name]["fwd_ms"] * 1e9) for name in kernels}
        cells = [f"{tflops[name]:.0f}" for name in kernels]
        if peak:
            cells += [f"{tflops[name] / (peak[0] * BOUND[name.split('_')[-1]]):.2f}" for name in ours]
            cells.append(f"{4 * (m * k + m * n + 2 * k * n) / (peak[1] * 1e9):.2f}")
        else:
            cells += [""] * (len(ours) + 1)
        lines.append(f"| {row['model']} {row['layer']} {m}x{k}x{n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="s,m")
    parser.add_argument("--atoms", default="192,17280")
    parser.add_argument("--kernels", default="tf32,tf32x3,bf16x9", help="precisions of our kernels (fp16x3: Hopper)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--markdown", default=None, help="print the tables of a results JSON and exit")
    args = parser.parse_args()
    if args.markdown:
        with open(args.markdown) as f:
            results = json.load(f)
        print(markdown(results), roofline(results), sep="\n\n")
        return
    backends = {}
    for precision in args.kernels.split(","):
        if precision == "fp16x3":
            from ase_tcfp32._kernels.fp16x3 import Fp16x3Backend

            backends["gluon_fp16x3"] = Fp16x3Backend()
        else:
            backends[f"triton_{precision}"] = TritonBackend(precision)
    results = {"environment": environment(), "shapes": []}
    print(json.dumps(results["environment"]))
    head = f"{'model':5} {'atoms':>6} {'layer':26} {'M x K x N':>22} {'fp32 ms':>8}"
    head += "".join(f" {name + ' fwd/bwd x':>18}" for name in ["cublas_tf32", *backends])
    print(head)
    for size in args.models.split(","):
        for atoms in map(int, args.atoms.split(",")):
            for layer, m, k, n in pet_shapes(size, atoms):
                row = bench_shape(m, k, n, backends)
                row.update(model=f"pet-mad-{size}", atoms=atoms, layer=layer)
                results["shapes"].append(row)
                base = row["cublas_fp32"]
                line = f"{size:5} {atoms:6d} {layer:26} {f'{m}x{k}x{n}':>22} {base['fwd_ms']:8.3f}"
                for name in ["cublas_tf32", *backends]:
                    r = row[name]
                    line += f" {base['fwd_ms'] / r['fwd_ms']:5.2f}/{base['bwd_ms'] / r['bwd_ms']:5.2f} e{r['err_fwd'] / base['err_fwd']:5.2f}"
                print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
