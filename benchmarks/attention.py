"""PET attention: torch's FP32 SDPA (as metatrain calls it) against ``tc_attention``.

    python benchmarks/attention.py [--models s,m] [--atoms 192,17280] [--configs default] [--out results.json]

Writes its rows into ``benchmarks/results/attention_<gpu>.json`` (``--out``: elsewhere),
replacing the rows of the same model, size, kernel and configuration.

For the PET-MAD-S / -M attention shapes (8 heads of d_pet / 8; T = neighbors + 1 tokens
of water at 1 g/cm³, from ``gemm.PAD_WIDTH``; the mask is the log of per-key cutoff
weights, repeated over the query rows, padding keys at PET's clamp 1e-15) it times, in
the same run, the forward and the forward + backward (gradients of the tokens' q, k, v
and of the mask, what forces need) of both, and reports speed-ups against SDPA and
errors against FP64 on the first 1024 atoms: the largest normwise relative error of
one (atom, head) output, and normwise relative errors of the gradients.

``--configs`` adds launch configurations of our kernel to try (``BLOCK:warps:stages``,
comma-separated; ``default`` is the one the package picks) and ``packed``: our kernels on
the sequences the lean engine gives them (``tc_attention_packed``: each atom's real tokens
only, as many as PET-MAD's cutoffs keep in water at 1 g/cm³, the center token in its own
tensor, a bias per key), errors against FP64 of the packed form (no padding keys, where
SDPA's weigh 1e-15). SDPA runs on metatrain's table, padded to the most neighbors.
"""

from __future__ import annotations

import argparse

import _results
import torch
import torch.nn.functional as F
import triton
from gemm import PAD_WIDTH
from triton.testing import do_bench

from ase_tcfp32._attention import packed_attention_in_torch, tc_attention, tc_attention_packed
from ase_tcfp32._kernels import attention as kernels
from ase_tcfp32._lean import MARGIN, LeanPET
from ase_tcfp32.testing import random_pet
from ase_tcfp32.validation import water_box

HEADS = 8
D_PET = {"s": 256, "m": 384}
CHECKED = 1024
"""Atoms whose results are compared with FP64."""


def inputs(size: str, atoms: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """qkv [B, T, 3C], mask [B, T, T] and the scale of a PET attention call."""
    tokens, width = PAD_WIDTH[(size, atoms)] + 1, D_PET[size]
    g = torch.Generator(device="cuda").manual_seed(atoms + width)
    qkv = torch.randn(atoms, tokens, 3 * width, device="cuda", generator=g)
    weights = torch.rand(atoms, tokens, device="cuda", generator=g) ** 2
    weights[:, 0] = 1.0  # the central token
    weights[:, -3:] = 0.0  # padding slots
    mask = torch.log(torch.clamp(weights[:, None, :].repeat(1, tokens, 1), 1e-15))
    return qkv, mask, 1.0 / (width // HEADS) ** 0.5


def sdpa(qkv: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """metatrain's AttentionBlock between its two projections."""
    atoms, tokens, width = qkv.shape
    x = qkv.reshape(atoms, tokens, 3, HEADS, width // (3 * HEADS)).permute(2, 0, 3, 1, 4)
    out = F.scaled_dot_product_attention(x[0], x[1], x[2], attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2).reshape(atoms, tokens, width // 3)


def ours(launch: dict | None):
    if launch is None:
        return lambda qkv, mask, scale: tc_attention(qkv, mask, HEADS, scale)
    return lambda qkv, mask, scale: _Launch.apply(qkv, mask, scale, launch)


class _Launch(torch.autograd.Function):
    """``tc_attention`` with a given launch configuration."""

    @staticmethod
    def forward(ctx, qkv, mask, scale, launch):
        ctx.save_for_backward(qkv, mask)
        ctx.scale, ctx.launch = scale, launch
        return kernels.forward(qkv, mask, HEADS, scale, launch)

    @staticmethod
    def backward(ctx, grad):
        qkv, mask = ctx.saved_tensors
        return (*kernels.backward(grad, qkv, mask, HEADS, ctx.scale, ctx.launch), None, None)


def errors(function, qkv, mask, scale, grad) -> dict:
    """Errors against FP64 on the first CHECKED atoms."""
    q, m, g = qkv[:CHECKED].clone().requires_grad_(), mask[:CHECKED].clone().requires_grad_(), grad[:CHECKED]
    out = function(q, m, scale)
    out.backward(g)
    q64, m64 = q.detach().double().requires_grad_(), m.detach().double().requires_grad_()
    x = q64.reshape(*q64.shape[:2], 3, HEADS, -1).permute(2, 0, 3, 1, 4)
    p = torch.softmax(x[0] @ x[1].transpose(-1, -2) * scale + m64[:, None], -1)
    exact = (p @ x[2]).transpose(1, 2).reshape(out.shape)
    exact.backward(g.double())
    per_head = lambda t: t.reshape(*t.shape[:2], HEADS, -1).transpose(1, 2).flatten(2)  # noqa: E731
    head_errors = (per_head(out.double()) - per_head(exact)).norm(dim=-1) / per_head(exact).norm(dim=-1)
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    return {
        "error": head_errors.max().item(),
        "error_grad_qkv": rel(q.grad, q64.grad),
        "error_grad_mask": rel(m.grad, m64.grad),
    }


def measure(size: str, atoms: int, name: str, function, config: dict | None) -> list[dict]:
    qkv, mask, scale = inputs(size, atoms)
    grad = torch.randn(*qkv.shape[:2], qkv.shape[2] // 3, device="cuda")
    forward_ms = do_bench(lambda: function(qkv, mask, scale), warmup=25, rep=200)
    qkv_g, mask_g = qkv.clone().requires_grad_(), mask.clone().requires_grad_()

    def both():
        qkv_g.grad = mask_g.grad = None
        function(qkv_g, mask_g, scale).backward(grad)

    both_ms = do_bench(both, warmup=25, rep=200)
    row = {
        "model": size,
        "atoms": atoms,
        "tokens": qkv.shape[1],
        "kernel": name,
        "config": config,
        **errors(function, qkv, mask, scale, grad),
    }
    return [dict(row, **{"pass": "fwd", "ms": forward_ms}), dict(row, **{"pass": "fwd+bwd", "ms": both_ms})]


def water_counts(size: str, atoms: int) -> torch.Tensor:
    """The neighbors [atoms] that PET-MAD-S / -M keep for each atom of water at 1 g/cm³
    (:meth:`LeanPET.neighbor_counts` with random weights of the shape: the counts depend
    on its cutoff hypers only)."""
    lean = LeanPET(random_pet(size), torch.device("cuda"), packed=True)
    return lean.neighbor_counts([water_box(atoms // 3)])


def measure_packed(size: str, atoms: int) -> list[dict]:
    """``tc_attention_packed`` on the sequences of water (:func:`water_counts`: each atom's
    real tokens only, the center token in its own tensor, a bias per key), random inputs as
    :func:`inputs`; ``fit`` is :func:`ase_tcfp32._kernels.attention.packed_blocks`, which the
    forward times include."""
    counts, width = water_counts(size, atoms), D_PET[size]
    tokens, scale = int(counts.max()) + 1 + MARGIN, 1 / (width // HEADS) ** 0.5  # tokens: as the lean engine tiles them
    g = torch.Generator(device="cuda").manual_seed(atoms + width)
    first, total = torch.cumsum(counts, 0) - counts, int(counts.sum())
    edge_qkv = torch.randn(total, 3 * width, device="cuda", generator=g)
    node_qkv = torch.randn(atoms, 3 * width, device="cuda", generator=g)
    bias = torch.log(torch.clamp(torch.rand(total, device="cuda", generator=g) ** 2, 1e-15))
    sequences = kernels.Sequences(first, counts, counts.sum(), tokens)
    blocks = kernels.packed_blocks(sequences, HEADS, width // HEADS)
    fit_ms = do_bench(lambda: kernels.packed_blocks(sequences, HEADS, width // HEADS), warmup=25, rep=200)
    grads = torch.randn(total, width, device="cuda"), torch.randn(atoms, width, device="cuda")
    forward_ms = do_bench(
        lambda: tc_attention_packed(edge_qkv, node_qkv, bias, sequences, HEADS, scale), warmup=25, rep=200
    )
    leaves = [t.clone().requires_grad_() for t in (edge_qkv, node_qkv, bias)]

    def both():
        for t in leaves:
            t.grad = None
        torch.autograd.backward(tc_attention_packed(*leaves, sequences, HEADS, scale), grads)

    both_ms = do_bench(both, warmup=25, rep=200)
    n = min(atoms, CHECKED)
    rows = int(first[n - 1] + counts[n - 1])
    checked = kernels.Sequences(first[:n], counts[:n], torch.tensor(rows, device="cuda"), tokens)
    slot = torch.arange(tokens - 1, device="cuda")
    real = slot < counts[:n, None]  # [n, T - 1]
    at = torch.where(real, first[:n, None] + slot, 0)

    def by_sequence(edge: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
        """[n, T, C]: each atom's tokens, center first, zeros past its last."""
        return torch.cat([node[:, None], torch.where(real[..., None], edge[at], 0)], 1)

    found = {}
    for name, function, dtype in (
        ("ours", tc_attention_packed, torch.float32),
        ("exact", packed_attention_in_torch, torch.float64),
    ):
        part = [
            t[: rows if len(t) == total else n].detach().to(dtype).clone().requires_grad_()
            for t in (edge_qkv, node_qkv, bias)
        ]
        out = function(*part, checked, HEADS, scale)
        torch.autograd.backward(out, [g[: len(o)].to(dtype) for g, o in zip(grads, out)])
        found[name] = by_sequence(*out), torch.cat([part[1].grad, part[0].grad]), part[2].grad
    per_head = lambda t: t.reshape(*t.shape[:2], HEADS, -1).transpose(1, 2).flatten(2)  # noqa: E731
    (out, grad_qkv, grad_bias), (exact, exact_qkv, exact_bias) = found["ours"], found["exact"]
    head_errors = (per_head(out.double()) - per_head(exact)).norm(dim=-1) / per_head(exact).norm(dim=-1)
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    used = int((blocks.table[:, 1] > 0).sum())
    row = {
        "model": size,
        "atoms": atoms,
        "tokens": tokens,
        "kernel": "tc_attention_packed",
        "config": "packed",
        "neighbors": {"min": int(counts.min()), "mean": counts.double().mean().item(), "max": int(counts.max())},
        "blocks": used,
        "atoms_per_block": atoms / used,
        "fit_ms": fit_ms,
        "error": head_errors.max().item(),
        "error_grad_qkv": rel(grad_qkv, exact_qkv),
        "error_grad_mask": rel(grad_bias, exact_bias),
    }
    return [dict(row, **{"pass": "fwd", "ms": forward_ms}), dict(row, **{"pass": "fwd+bwd", "ms": both_ms})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="s,m")
    parser.add_argument("--atoms", default="192,17280")
    parser.add_argument("--configs", default="default", help="'default' and/or BLOCK:warps:stages, comma-separated")
    parser.add_argument("--out", default=None, help="results file (default: benchmarks/results/attention_<gpu>.json)")
    args = parser.parse_args()
    rows = []
    for size in args.models.split(","):
        for atoms in map(int, args.atoms.split(",")):
            base = {}
            for spec in ["sdpa", *args.configs.split(",")]:
                if spec == "sdpa":
                    name, function, config = "sdpa", sdpa, None
                elif spec == "packed":
                    name, function, config = "tc_attention_packed", None, "packed"
                elif spec == "default":
                    shape = (PAD_WIDTH[(size, atoms)] + 1, D_PET[size] // HEADS)
                    config = {"forward": kernels.config(*shape), "backward": kernels.config(*shape, backward=True)}
                    name, function = "tc_attention", ours(None)
                else:
                    block, warps, stages = map(int, spec.split(":"))
                    config = dict(BLOCK=block, num_warps=warps, STAGES=stages)
                    name, function = "tc_attention", ours(config)
                try:
                    found = (
                        measure_packed(size, atoms)
                        if spec == "packed"
                        else measure(size, atoms, name, function, config)
                    )
                except triton.runtime.errors.OutOfResources as error:
                    print(f"{size} {atoms:6d} {config}: {error}", flush=True)
                    continue
                for r in found:
                    if spec == "default":  # the package's launch: named in the key, its parameters kept
                        r["config"], r["launch"] = "default", r["config"]
                    base.setdefault(r["pass"], r["ms"])  # SDPA's, measured first
                    r["speedup_vs_sdpa"] = base[r["pass"]] / r["ms"]
                    print(
                        f"{size} {atoms:6d} T={r['tokens']} {name:13s} {str(config):48s} {r['pass']:8s} "
                        f"{r['ms']:8.3f} ms  x{r['speedup_vs_sdpa']:.2f}  err {r['error']:.2e} "
                        f"grad {r['error_grad_qkv']:.2e}/{r['error_grad_mask']:.2e}",
                        flush=True,
                    )
                rows += found
                _results.write("attention", rows, ("model", "atoms", "kernel", "config", "pass"), out=args.out)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
