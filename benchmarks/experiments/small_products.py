"""Products too small to fill the GPU: cuBLAS FP32 against the fp16x3 kernel summing each
output tile in parts of its K-tiles (``fp16x3.launch(..., splits=S)``), in CUDA graphs
(Triton's ``do_bench_cudagraph``, as a replayed MD step runs them): µs per product, error vs
FP64 as a multiple of cuBLAS FP32's, and the package's choice (``triton_gemm.parts``).

    python benchmarks/experiments/small_products.py [--rows 64,192,576,1152] [--kernels fp16x3,tf32x3]
                                                    [--out small_products.json]

Shapes: PET-S's and PET-M's node update (the center MLP, forward and input gradient) and
the edge products with 128 outputs, whose tiles occupy a few dozen of the GPU's
multiprocessors at a few hundred atoms; the fp16x3 kernel and the Triton tf32x3 kernel
(``triton_gemm.launch(..., rows=64, splits=S)``). Decided (design page, "Small products"):
the products summed in parts and the work from which they are.
"""

import argparse
import json

import torch
from triton.testing import do_bench_cudagraph

from ase_tcfp32._kernels import fp16x3, triton_gemm
from ase_tcfp32._kernels.triton_gemm import min_rows

NODE = {"s": 1024, "m": 1536}
"""The node width d_node of PET-S and PET-M (4 d_pet)."""


def shapes(rows: list[int]) -> list[tuple[str, int, int, int]]:
    """(name, M, K, N) of the products measured."""
    out = []
    for size, dn in NODE.items():
        for m in rows:
            out += [
                (f"{size} center w_in", m, dn, 4 * dn),
                (f"{size} center w_out", m, 2 * dn, dn),
                (f"{size} center w_in dX", m, 4 * dn, dn),
                (f"{size} center w_out dX", m, dn, 2 * dn),
            ]
    for m in (6144, 7296):
        out += [("edge 256 -> 128", m, 256, 128), ("edge 128 -> 256", m, 128, 256), ("edge 512 -> 128", m, 512, 128)]
    return out


def error(y: torch.Tensor, exact: torch.Tensor) -> float:
    return ((y.double() - exact).norm() / exact.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="64,192,576,1152")
    parser.add_argument("--kernels", default="fp16x3")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = []
    for kernel in args.kernels.split(","):
        results += measure(kernel, [int(r) for r in args.rows.split(",")])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


def measure(kernel: str, rows: list[int]) -> list[dict]:
    """Rows of results for ``kernel`` (fp16x3, or a precision of the Triton kernel)."""
    results = []
    if kernel == "fp16x3":
        configs = {"128": fp16x3.CONFIG, "64": fp16x3.SMALL}
    else:
        configs = {"tuned": None, "64": triton_gemm.small(triton_gemm.SMALL_ROWS)}
        backend = triton_gemm.TritonBackend(kernel)
    for name, m, k, n in shapes(rows):
        g = torch.Generator(device="cuda").manual_seed(m + k + n)
        x = torch.randn(m, k, device="cuda", generator=g)
        w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
        b = torch.randn(n, device="cuda", generator=g)
        exact = x.double() @ w.double().T + b.double()
        if kernel == "fp16x3":
            words = fp16x3.split_weight(w)
            small = fp16x3.SMALL
        else:
            words = backend.prepare(w).forward
            small = dict(words.config, **configs["64"])
        fp32 = error(x @ w.T + b, exact)
        row = {"kernel": kernel, "name": name, "M": m, "K": k, "N": n, "min_rows": min_rows(n, k, x.device)}
        row["chosen_parts"] = triton_gemm.parts(m, n, k, x.device, small)
        row["cublas_us"] = 1000 * do_bench_cudagraph(lambda: torch.nn.functional.linear(x, w, b), rep=50)
        for label, config in configs.items():
            for splits in (1, 2, 4, 8, 16):
                if not triton_gemm.parts_fit(-(-k // 32), splits) or (label == "tuned" and splits > 1):
                    continue

                def run(config=config, splits=splits):
                    if kernel == "fp16x3":
                        return fp16x3.launch(x, words, b, config, splits=splits)
                    rows = None if config is None else triton_gemm.SMALL_ROWS
                    return triton_gemm.launch(x, words, b, rows=rows, splits=splits)

                y = run()
                row[f"BM{label}_S{splits}_us"] = 1000 * do_bench_cudagraph(run, rep=50)
                row[f"BM{label}_S{splits}_err"] = error(y, exact) / fp32
        best = min((v, key) for key, v in row.items() if key.endswith("_us"))
        print(
            f"{kernel} {name:22s} M={m:5d} K={k:4d} N={n:4d} min_rows={row['min_rows']:5d} chosen S={row['chosen_parts']}: "
            f"cuBLAS {row['cublas_us']:.1f} µs; best {best[1]} {best[0]:.1f}; "
            + " ".join(f"{key[:-3]}={v:.1f}" for key, v in row.items() if key.endswith("_us") and key != "cublas_us")
            + f"; err/fp32 max {max(v for key, v in row.items() if key.endswith('_err')):.2f}",
            flush=True,
        )
        results.append(row)
    return results


if __name__ == "__main__":
    main()
