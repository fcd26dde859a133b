"""PET's fused stages against metatrain's eager expressions: the SwiGLU
(``ase_tcfp32._fused.swiglu``) and the message combination (``combine_messages``).

    python benchmarks/fused.py [--models s,m] [--atoms 192,17280] [--out results.json]

For the feed-forward shapes of PET-MAD-S / -M (the edge tokens' ``mlp``: atoms x W rows of
``d_feedforward = 2 d_pet``; the atoms' ``center_mlp``: atoms rows of ``2 d_node = 8
d_pet``; W of water at 1 g/cm³ from ``gemm.PAD_WIDTH``) it times, in the same run, the
forward and the forward + backward of both, and reports the speed-ups and the largest
errors against FP64 (in units of 2^-24, relative to |v|, and to |dh v| for the gate's
gradient).

For the message combination, ``LayerNorm(cat(o, o[reverse]))`` over atoms x W slots of
d_pet features with a random involution as ``reverse`` (scattered rows: no better
locality than a real neighbor list), it times metatrain's expression (gather, ``cat``,
``layer_norm``) against the kernels, and reports the largest errors against FP64 (2^-24
times the output's scale).
"""

from __future__ import annotations

import argparse

import _results
import torch
from gemm import PAD_WIDTH
from triton.testing import do_bench

from ase_tcfp32._fused import combine_messages, swiglu

D_PET = {"s": 256, "m": 384}


def eager(y: torch.Tensor) -> torch.Tensor:
    v, g = y.chunk(2, dim=-1)
    return v * torch.sigmoid(g)


def errors(function, y: torch.Tensor, grad: torch.Tensor) -> dict:
    """Largest errors of ``function`` vs FP64 on ``y``'s first 4096 rows, in units of 2^-24."""
    y, grad = y[:4096].clone().requires_grad_(), grad[:4096]
    h = function(y)
    h.backward(grad)
    v, s = y.detach().double().chunk(2, dim=-1)
    s, grad = torch.sigmoid(s), grad.double()
    dv, dg = y.grad.double().chunk(2, dim=-1)
    worst = lambda error, size: (error / size)[size > 0].max().item() / 2.0**-24  # noqa: E731
    return {
        "h": worst((h.double() - v * s).abs(), v.abs()),
        "dv": worst((dv - grad * s).abs(), grad.abs()),
        "dg": worst((dg - grad * v * s * (1 - s)).abs(), (grad * v).abs()),
    }


def measure(size: str, atoms: int) -> list[dict]:
    d, width = D_PET[size], PAD_WIDTH[(size, atoms)]
    rows = []
    for layer, m, features in [("mlp", atoms * width, 2 * d), ("center_mlp", atoms, 8 * d)]:
        g = torch.Generator(device="cuda").manual_seed(m)
        y = torch.randn(m, 2 * features, device="cuda", generator=g).requires_grad_()
        grad = torch.randn(m, features, device="cuda", generator=g)
        row = {"model": size, "atoms": atoms, "layer": layer, "shape": [m, 2 * features]}
        for name, function in (("eager", eager), ("fused", swiglu)):
            row[f"{name}_forward_ms"] = do_bench(lambda: function(y.detach()), warmup=5, rep=40)
            row[f"{name}_forward_backward_ms"] = do_bench(
                lambda: torch.autograd.grad(function(y), y, grad), warmup=5, rep=40
            )
            row[f"{name}_errors_ulp"] = errors(function, y.detach(), grad)
        row["speedup_forward"] = row["eager_forward_ms"] / row["fused_forward_ms"]
        row["speedup_forward_backward"] = row["eager_forward_backward_ms"] / row["fused_forward_backward_ms"]
        rows.append(row)
    return rows


def combination_errors(
    o: torch.Tensor, reverse: torch.Tensor, norm: torch.nn.LayerNorm, grad: torch.Tensor, function
) -> dict:
    """Largest errors of ``function`` vs FP64 on ``o``'s first 512 atoms (slots whose reverse
    is not among them their own reverse), in units of 2^-24 times the output's largest value
    (y) and the gradient's (do)."""
    o, grad, reverse = o[:512].detach().clone().requires_grad_(), grad[:512], reverse[:512]
    slots = torch.arange(reverse.numel(), device=o.device).reshape(reverse.shape)
    reverse = torch.where(reverse < reverse.numel(), reverse, slots)
    y = function(o, reverse, norm)
    (do,) = torch.autograd.grad(y, o, grad)
    o64 = o.detach().double().requires_grad_()
    x = torch.cat([o64, o64.reshape(-1, o.shape[-1])[reverse.reshape(-1)].reshape(o.shape)], -1)
    exact = torch.nn.functional.layer_norm(x, x.shape[-1:], norm.weight.double(), norm.bias.double(), norm.eps)
    (do64,) = torch.autograd.grad(exact, o64, grad.double())
    worst = lambda a, b: ((a.double() - b).abs().max() / b.abs().max()).item() / 2.0**-24  # noqa: E731
    return {"y": worst(y, exact), "do": worst(do, do64)}


def eager_combination(o: torch.Tensor, reverse: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
    return norm(torch.cat([o, o.reshape(-1, o.shape[-1])[reverse.reshape(-1)].reshape(o.shape)], dim=-1))


def measure_combination(size: str, atoms: int) -> dict:
    d, width = D_PET[size], PAD_WIDTH[(size, atoms)]
    g = torch.Generator(device="cuda").manual_seed(atoms)
    n = atoms * width
    order = torch.randperm(n, device="cuda", generator=g)
    reverse = torch.empty(n, dtype=torch.long, device="cuda")
    reverse[order[0::2]], reverse[order[1::2]] = order[1::2], order[0::2]  # n even: every slot in a pair
    reverse = reverse.reshape(atoms, width)
    norm = torch.nn.LayerNorm(2 * d, device="cuda").requires_grad_(False)
    norm.weight.normal_(generator=g), norm.bias.normal_(generator=g)
    o = torch.randn(atoms, width, d, device="cuda", generator=g).requires_grad_()
    grad = torch.randn(atoms, width, 2 * d, device="cuda", generator=g)
    row = {"model": size, "atoms": atoms, "layer": "combination", "shape": [n, 2 * d]}
    for name, function in (("eager", eager_combination), ("fused", combine_messages)):
        row[f"{name}_forward_ms"] = do_bench(lambda: function(o.detach(), reverse, norm), warmup=5, rep=40)
        row[f"{name}_forward_backward_ms"] = do_bench(
            lambda: torch.autograd.grad(function(o, reverse, norm), o, grad), warmup=5, rep=40
        )
        row[f"{name}_errors_ulp"] = combination_errors(o, reverse, norm, grad, function)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="s,m")
    parser.add_argument("--atoms", default="192,17280")
    parser.add_argument("--out", default=None, help="results file (default: benchmarks/results/fused_<gpu>.json)")
    args = parser.parse_args()
    rows = [
        r for size in args.models.split(",") for atoms in map(int, args.atoms.split(",")) for r in measure(size, atoms)
    ]
    combinations = [
        measure_combination(size, atoms) for size in args.models.split(",") for atoms in map(int, args.atoms.split(","))
    ]
    print(
        "model  atoms  layer       rows x 2F          eager fwd / +bwd ms   fused fwd / +bwd ms   speed-up   err h/dv/dg (2^-24)"
    )
    for r in rows:
        e = r["fused_errors_ulp"]
        print(
            f"{r['model']:>5} {r['atoms']:>6}  {r['layer']:<10} {r['shape'][0]:>8} x {r['shape'][1]:<5} "
            f"{r['eager_forward_ms']:8.3f} / {r['eager_forward_backward_ms']:8.3f}   "
            f"{r['fused_forward_ms']:8.3f} / {r['fused_forward_backward_ms']:8.3f}   "
            f"{r['speedup_forward']:.2f} / {r['speedup_forward_backward']:.2f}x  "
            f"{e['h']:.1f} / {e['dv']:.1f} / {e['dg']:.1f}"
        )
    print("model  atoms  combination rows x 2D   fwd / fwd+bwd ms, eager and fused   err y/do (2^-24)")
    for r in combinations:
        times = "  ".join(
            f"{k[:-11]} {r[k]:.3f}/{r[k.replace('forward_ms', 'forward_backward_ms')]:.3f}"
            for k in r
            if k.endswith("_forward_ms")
        )
        errors = "  ".join(f"{k[:-11]} {v['y']:.1f}/{v['do']:.1f}" for k, v in r.items() if k.endswith("_errors_ulp"))
        print(f"{r['model']:>5} {r['atoms']:>6}  {r['shape'][0]:>8} x {r['shape'][1]:<5}  {times}   {errors}")
    _results.write("fused", rows + combinations, ("model", "atoms", "layer"), out=args.out)


if __name__ == "__main__":
    main()
