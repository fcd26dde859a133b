"""GEMM speed and accuracy on PET shapes: cuBLAS FP32 / TF32 against our kernels.

    python benchmarks/gemm.py [--models s,m] [--atoms 192,17280] [--kernels tf32,tf32x3,fp16x3,bf16x9]
                              [--out results.json]

For each Linear of PET-MAD-S / -M (shapes from the PET-MAD hyperparameters, M = atoms x
padded neighbors or atoms x (neighbors + 1), water at 1 g/cm³) it times the forward
y = x W^T + b and the force backward dX = dY W with cuBLAS FP32 (IEEE), cuBLAS TF32 and
each of our kernels (Triton; the Gluon fp16x3 kernel on Hopper), in the same run, and
prints speed-ups against cuBLAS FP32 and relative Frobenius errors against FP64 (first 16384 rows). Our backends send GEMMs too small to
fill the GPU to cuBLAS FP32, as the calculator does.

Writes one row per (model, atoms, layer, method) into ``benchmarks/results/gemm_<gpu>.json``
(``--out``: elsewhere), each with the same run's cuBLAS FP32 time and error (``fp32_*``),
replacing older rows of the same layer and method.
"""

from __future__ import annotations

import argparse

import _results
import torch
from triton.testing import do_bench

from ase_tcfp32._kernels.cublas import version as cublas_version
from ase_tcfp32._kernels.triton_gemm import TritonBackend

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
    """The run's versions and GPU (:func:`_results.environment`) and cuBLAS's version."""
    return {**_results.environment("cuda"), "cublas": cublas_version()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="s,m")
    parser.add_argument("--atoms", default="192,17280")
    parser.add_argument("--kernels", default="tf32,tf32x3,bf16x9", help="precisions of our kernels (fp16x3: Hopper)")
    parser.add_argument("--out", default=None, help="results file (default: benchmarks/results/gemm_<gpu>.json)")
    args = parser.parse_args()
    backends = {}
    for precision in args.kernels.split(","):
        if precision == "fp16x3":
            from ase_tcfp32._kernels.fp16x3 import Fp16x3Backend

            backends["gluon_fp16x3"] = Fp16x3Backend()
        else:
            backends[f"triton_{precision}"] = TritonBackend(precision)
    env = environment()
    print(env)
    rows = []
    head = f"{'model':5} {'atoms':>6} {'layer':26} {'M x K x N':>22} {'fp32 ms':>8}"
    head += "".join(f" {name + ' fwd/bwd x':>18}" for name in ["cublas_tf32", *backends])
    print(head)
    for size in args.models.split(","):
        for atoms in map(int, args.atoms.split(",")):
            for layer, m, k, n in pet_shapes(size, atoms):
                row = bench_shape(m, k, n, backends)
                base = row["cublas_fp32"]
                shape = {"model": f"pet-mad-{size}", "atoms": atoms, "layer": layer, "M": m, "K": k, "N": n}
                fp32 = {f"fp32_{name}": value for name, value in base.items()}
                rows += [{**shape, "method": name, **row[name], **fp32} for name in ["cublas_tf32", *backends]]
                _results.write("gemm", rows, ("model", "atoms", "layer", "method"), env=env, out=args.out)
                line = f"{size:5} {atoms:6d} {layer:26} {f'{m}x{k}x{n}':>22} {base['fwd_ms']:8.3f}"
                for name in ["cublas_tf32", *backends]:
                    r = row[name]
                    line += f" {base['fwd_ms'] / r['fwd_ms']:5.2f}/{base['bwd_ms'] / r['bwd_ms']:5.2f} e{r['err_fwd'] / base['err_fwd']:5.2f}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
