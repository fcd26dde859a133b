"""Does the tensor-core model predict our Triton kernels' bits on this GPU?

    python benchmarks/tcmodel_vs_gpu.py [--gpu-model H100]

Runs each kernel on the GPU and the model of ``--gpu-model`` (and of A100, for contrast)
on the CPU with the same inputs; prints the share of bit-identical outputs and the
largest difference in units of the last place.
"""

import argparse
import json

import numpy as np
import torch

from ase_tcfp32.kernels.triton_gemm import TritonBackend
from ase_tcfp32.tcmodel import emulated_matmul


def _variant(x, w, precision, gpu, *, lo_round=None, fold_acc=False, hi_first=False):
    """Alternative readings of the kernel, to find which one the hardware follows."""
    from ase_tcfp32.kernels.reference import SCHEMES
    from ase_tcfp32.tcmodel.core import _chain
    from ase_tcfp32.tcmodel.emulation import _IN_FMT, _words
    from ase_tcfp32.tcmodel.formats import round_to
    from ase_tcfp32.tcmodel.presets import tensor_core

    params = tensor_core(gpu).params(_IN_FMT[precision])
    fmt = _IN_FMT[precision]
    scheme = SCHEMES[precision]
    if precision == "tf32x3" and lo_round:
        xs = [round_to(x.astype(float), "tf32", "rna"), None]
        xs[1] = round_to(x.astype(np.float32) - xs[0].astype(np.float32), "tf32", lo_round)
        ws = [round_to(w.astype(float), "tf32", "rna"), None]
        ws[1] = round_to(w.astype(np.float32) - ws[0].astype(np.float32), "tf32", lo_round)
    else:
        xs, ws = _words(x, precision), _words(w, precision)
    ws = [v.T.copy() for v in ws]
    m, k = x.shape
    acc = np.zeros((m, w.shape[0]), dtype=np.float32)
    for k0 in range(0, k, 32):
        t = slice(k0, k0 + 32)
        small = np.zeros((m, w.shape[0]))
        pairs = list(scheme.small)
        if hi_first:
            small = _chain(xs[0][:, t], ws[0][t], small, params, fmt, "fp32")
            for i, j in pairs:
                small = _chain(xs[i][:, t], ws[j][t], small, params, fmt, "fp32")
            acc = acc + small.astype(np.float32)
            continue
        for i, j in pairs:
            small = _chain(xs[i][:, t], ws[j][t], small, params, fmt, "fp32")
        if fold_acc:
            acc = _chain(xs[0][:, t], ws[0][t], (acc + small.astype(np.float32)).astype(float), params, fmt, "fp32").astype(np.float32)
        else:
            acc = acc + _chain(xs[0][:, t], ws[0][t], small, params, fmt, "fp32").astype(np.float32)
    return acc


VARIANTS = {
    "lo_rne": lambda x, w, p, g: _variant(x, w, p, g, lo_round="rne"),
    "lo_rna": lambda x, w, p, g: _variant(x, w, p, g, lo_round="rna"),
    "fold_acc": lambda x, w, p, g: _variant(x, w, p, g, fold_acc=True),
    "hi_first": lambda x, w, p, g: _variant(x, w, p, g, hi_first=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-model", default="H100")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    results = {"gpu": torch.cuda.get_device_name(), "rows": []}
    for m, k, n in [(256, 256, 128), (300, 520, 136)]:
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = rng.standard_normal((n, k)).astype(np.float32)
        for precision in ("tf32", "tf32x3", "bf16x9"):
            backend = TritonBackend(precision)
            xt, wt = torch.from_numpy(x).cuda(), torch.from_numpy(w).cuda()
            gpu = backend.forward(xt, backend.prepare(wt), None).cpu().numpy()
            for model in (args.gpu_model, "A100"):
                predicted = emulated_matmul(x, w, precision, model)
                if precision != "tf32" and model != "A100":
                    for name, variant in VARIANTS.items():
                        guess = variant(x, w, precision, model)
                        same = float(np.mean(guess.view(np.uint32) == gpu.view(np.uint32)))
                        print(json.dumps({"shape": f"{m}x{k}x{n}", "precision": precision, "variant": name, "identical": same}))
                same = float(np.mean(predicted.view(np.uint32) == gpu.view(np.uint32)))
                ulp = int(np.abs(predicted.view(np.int32).astype(np.int64) - gpu.view(np.int32).astype(np.int64)).max())
                row = {"shape": f"{m}x{k}x{n}", "precision": precision, "model": model, "identical": same, "max_ulp": ulp}
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
