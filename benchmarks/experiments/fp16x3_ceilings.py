"""Two ceilings of the fp16x3 kernel: its consumers as two independent partitions, and its split removed.

    python benchmarks/experiments/fp16x3_ceilings.py --compile     # offline, sm_90 (Triton 3.6), no GPU
    python benchmarks/experiments/fp16x3_ceilings.py --out ab.json # on a Hopper GPU

Both variants are the package kernel (``ase_tcfp32/_kernels/fp16x3.py``) rewritten by the
text substitutions below, so that they follow it without a copy of its code (a substitution
that no longer matches stops the script):

- ``partitions``: the two consumer warpgroups become two warp-specialised partitions of 4
  warps, each computing 64 rows of every 128-row tile with its own output buffers, and each
  ring stage is freed once both have arrived. The package's consumers form one 8-warp
  partition, and Triton places three CTA-wide barriers in its K loop (before waiting for a
  stage, before freeing one, before issuing the products): the warpgroups run in lockstep.
  Here each partition syncs only its own 128 threads. Same arithmetic, same bits.
- ``no_split``: each K-tile of x becomes its FP16 conversion used as all three words, with
  no row scales (wrong products: a timing of the kernel without its split, the per-element
  work the consumers do between products).

The A/B times the package kernel and each variant (``do_bench``) on PET-MAD-S/-M's large
17,280-atom shapes, forward and input gradient, and checks that ``partitions`` gives the
package's bits. Measured on the H200 (``docs/design.md``, "The fp16x3 kernel's ceilings"):
``partitions`` 0.98-1.06x the package's speed, ``no_split`` 1.10-1.24x; so neither the
lockstep nor the split is what holds the kernel at ~0.4 of its tensor-core bound.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from ase_tcfp32._kernels import fp16x3

SOURCE = Path(fp16x3.__file__)


def _substitute(text: str, pairs: list[tuple[str, str]]) -> str:
    for old, new in pairs:
        if text.count(old) != 1:
            raise RuntimeError(f"the package kernel changed: {old[:60]!r} found {text.count(old)} times")
        text = text.replace(old, new)
    return text


def _imports(text: str) -> str:
    """The module's relative imports made absolute (it is loaded from a temporary file)."""
    return re.sub(
        r"^from \.(\w*) import",
        lambda m: f"from ase_tcfp32._kernels{'.' + m[1] if m[1] else ''} import",
        text,
        flags=re.M,
    )


def _args(ys: str, zs: str, half: int) -> str:
    return (
        f"(xs, his, los, ready, empty, {ys}, y_desc, {zs}, z_desc, g_desc, scale_ptr, bias_ptr, residual_ptr, stride_r, "
        "table_ptr, index_ptr, geometry_ptr, matrix_ptr, inv_k, eps, M, N, num_k, HAS_BIAS, HAS_RESIDUAL, EMBED, "
        f"ACTIVATION, RMS, KEEP, GROUP_M, STAGES, SPLITS, {half}, num_warps)"
    )


def partitions_source() -> str:
    text = _imports(SOURCE.read_text())
    start = text.index("    gl.warp_specialize(\n        [\n            (\n                _fp16x3_consumer,")
    end = text.index("        [24],\n    )\n", start) + len("        [24],\n    )\n")
    text = (
        text[:start]
        + "    gl.warp_specialize(\n        [\n"
        + f"            (_fp16x3_consumer, {_args('ys0', 'zs0', 0)}),\n"
        + f"            (_fp16x3_consumer, {_args('ys1', 'zs1', 1)}),\n"
        + "            (_loader, (x_desc, hi_desc, lo_desc, xs, his, los, ready, empty, M, N, GROUP_M, STAGES, SPLITS)),\n"
        + "        ],\n        [4, 1],\n        [REGS, 24],\n    )\n"
        + text[end:]
    )
    return _substitute(
        text,
        [
            (
                '    SPLITS: gl.constexpr,\n    num_warps: gl.constexpr,\n):\n    """Consumer',
                '    SPLITS: gl.constexpr,\n    HALF: gl.constexpr,\n    num_warps: gl.constexpr,\n):\n    """Consumer',
            ),
            (
                "    BM: gl.constexpr = xs.shape[1]\n    BN: gl.constexpr = his.shape[1]\n",
                "    BM: gl.constexpr = xs.shape[1]\n    HM: gl.constexpr = BM // 2\n    BN: gl.constexpr = his.shape[1]\n",
            ),
            ("warps_per_cta=[num_warps, 1]", "warps_per_cta=[4, 1]"),
            ("zero = gl.zeros((BM, BN), gl.float32, mma)", "zero = gl.zeros((HM, BN), gl.float32, mma)"),
            (
                "hi, lo, hi_c, down, squares = _split(xs.index(s), a_layout",
                "hi, lo, hi_c, down, squares = _split(xs.index(s).slice(HALF * HM, HM), a_layout",
            ),
            (
                "next_hi, next_lo, next_hi_c, next_down, more = _split(xs.index(s), a_layout",
                "next_hi, next_lo, next_hi_c, next_down, more = _split(xs.index(s).slice(HALF * HM, HM), a_layout",
            ),
            (
                "rows = (off_m + gl.arange(0, BM, layout=rows_layout)).to(gl.int64)",
                "rows = (off_m + HALF * HM + gl.arange(0, HM, layout=rows_layout)).to(gl.int64)",
            ),
            ("gl.reshape(acc, [BM, BN // 2, 2])", "gl.reshape(acc, [HM, BN // 2, 2])"),
            ("row = off_m + part * (gl.cdiv(M, BM) * BM)", "row = off_m + HALF * HM + part * (gl.cdiv(M, BM) * BM)"),
            ("(z_desc, [off_m, off_n", "(z_desc, [off_m + HALF * HM, off_n"),
            ("(g_desc, [off_m, off_n", "(g_desc, [off_m + HALF * HM, off_n"),
            (
                '    SPLITS: gl.constexpr,\n    num_warps: gl.constexpr,\n):\n    """``y = act(',
                '    SPLITS: gl.constexpr,\n    REGS: gl.constexpr,\n    num_warps: gl.constexpr,\n):\n    """``y = act(',
            ),
            (
                "    xs, his, los, ready, empty = ring(x_desc, hi_desc, lo_desc, STAGES)\n"
                "    ys = gl.allocate_shared_memory(gl.float32, y_desc.block_type.shape, y_desc.layout)\n",
                "    xs, his, los, ready, empty = ring(x_desc, hi_desc, lo_desc, STAGES)\n"
                "    for i in gl.static_range(STAGES):  # both partitions free a stage\n"
                "        mbarrier.invalidate(empty.index(i))\n        mbarrier.init(empty.index(i), count=2)\n"
                "    ys0 = gl.allocate_shared_memory(gl.float32, y_desc.block_type.shape, y_desc.layout)\n"
                "    ys1 = gl.allocate_shared_memory(gl.float32, y_desc.block_type.shape, y_desc.layout)\n",
            ),
            (
                "    zs = gl.allocate_shared_memory(gl.float32, [2 if ACTIVATION == 2 else 1, ZM, ZN], z_desc.layout)\n",
                "    zs0 = gl.allocate_shared_memory(gl.float32, [2 if ACTIVATION == 2 else 1, ZM, ZN], z_desc.layout)\n"
                "    zs1 = gl.allocate_shared_memory(gl.float32, [2 if ACTIVATION == 2 else 1, ZM, ZN], z_desc.layout)\n",
            ),
            (
                'tile = [bm, bn // 2 if activation == "swiglu" else bn]',
                'tile = [bm // 2, bn // 2 if activation == "swiglu" else bn]',
            ),
            (
                '            num_warps=config["num_warps"],\n        )',
                '            REGS=config.get("REGS", 232),\n            num_warps=4,\n        )',
            ),
        ],
    )


def no_split_source() -> str:
    text = _imports(SOURCE.read_text())
    start = text.index("    x = x_s.load(a_layout)\n")
    end = text.index("    return hi, lo, hi_c, gl.convert_layout(down, rows_layout), row\n")
    end += len("    return hi, lo, hi_c, gl.convert_layout(down, rows_layout), row\n")
    return (
        text[:start]
        + "    x = x_s.load(a_layout)\n"
        + "    row = gl.full([x.shape[0]], 1.0, gl.float32, gl.SliceLayout(1, a_layout))\n"
        + "    hi = x.to(gl.float16)\n"
        + "    return hi, hi, hi, gl.convert_layout(row, rows_layout), row\n"
        + text[end:]
    )


def load(name: str, source: str):
    """``source`` as a module (Gluon reads a kernel's source from its file)."""
    path = Path(tempfile.mkdtemp()) / f"fp16x3_{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


VARIANTS = {"partitions": partitions_source, "no_split": no_split_source}


def shapes(model: str, atoms: int = 17280) -> list[tuple[str, int, int, int]]:
    """(layer, M, K, N) of PET-MAD-S/-M's large layers (``benchmarks/gemm.py``'s widths)."""
    d, width = {"s": (256, 39), "m": (384, 51)}[model]
    edges, tokens = atoms * width, atoms * (width + 1)
    return [
        ("compress.0", edges, 3 * d, d),
        ("compress.2", edges, d, d),
        ("attention.input_linear", tokens, d, 3 * d),
        ("mlp.w_in", edges, d, 4 * d),
        ("mlp.w_out", edges, 2 * d, d),
        ("combination_mlp.0", edges, 2 * d, 2 * d),
        ("center_mlp.w_in", atoms, 4 * d, 16 * d),
    ]


def compile_offline() -> None:
    """Each variant compiled for sm_90: wgmma, CTA-wide barriers, registers, spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    def descriptor(block, dtype):
        layout = gl.NVMMASharedLayout.get_default_for(block, {"fp32": gl.float32, "fp16": gl.float16}[dtype])
        return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{layout!r}>"

    c = fp16x3.CONFIG
    for name, module in [("package", fp16x3)] + [(n, load(n, f())) for n, f in VARIANTS.items()]:
        rows = c["BM"] // 2 if name == "partitions" else c["BM"]
        signature = {
            "x_desc": descriptor([c["BM"], c["BK"]], "fp32"),
            "hi_desc": descriptor([c["BN"], c["BK"]], "fp16"),
            "lo_desc": descriptor([c["BN"], c["BK"]], "fp16"),
            **{k: descriptor([rows, c["BN"]], "fp32") for k in ("y_desc", "z_desc", "g_desc")},
            **{
                k: "*fp32" for k in ("scale_ptr", "bias_ptr", "residual_ptr", "table_ptr", "geometry_ptr", "matrix_ptr")
            },
            "index_ptr": "*i64",
            "stride_r": "i32",
            "inv_k": "fp32",
            "eps": "fp32",
            "M": "i32",
            "N": "i32",
        }
        constants = dict(
            HAS_BIAS=True,
            HAS_RESIDUAL=False,
            EMBED=False,
            ACTIVATION=0,
            RMS=False,
            KEEP=False,
            STAGES=c["STAGES"],
            GROUP_M=c["GROUP_M"],
            SPLITS=1,
            num_warps=4 if name == "partitions" else c["num_warps"],
        )
        if name == "partitions":
            constants["REGS"] = 232
        signature.update({k: "constexpr" for k in constants})
        kernel = triton.compile(
            GluonASTSource(module._fp16x3_kernel, signature, constexprs=constants),
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=constants["num_warps"]),
        )
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", f.name + ".cubin"], capture_output=True, text=True
        ).stderr
        barriers = sorted(set(re.findall(r"bar\.sync \t\d+, (\d+);", kernel.asm["ptx"])))
        registers = re.findall(r"Used (\d+) registers", log)
        spills = re.findall(r"(\d+) bytes spill stores", log)
        wgmma = kernel.asm["ptx"].count("wgmma.mma_async")
        print(f"{name}: wgmma {wgmma}, bar.sync over {barriers} threads, registers {registers}, spills {spills}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="compile for sm_90 offline and print the structure")
    parser.add_argument("--models", default="s,m")
    parser.add_argument("--out", default=None, help="write the A/B as JSON here")
    args = parser.parse_args()
    if args.compile:
        compile_offline()
        return
    from triton.testing import do_bench

    variants = {name: load(name, f()) for name, f in VARIANTS.items()}
    rows = []
    for model in args.models.split(","):
        for layer, m, k, n in shapes(model):
            for direction, (kk, nn) in (("forward", (k, n)), ("input gradient", (n, k))):
                x = torch.randn(m, kk, device="cuda")
                words = fp16x3.split_weight(torch.randn(nn, kk, device="cuda") / kk**0.5)
                bias = torch.randn(nn, device="cuda")
                package = fp16x3.launch(x, words, bias)
                row = dict(model=model, layer=layer, direction=direction, M=m, K=kk, N=nn)
                row["package_ms"] = do_bench(lambda: fp16x3.launch(x, words, bias), warmup=50, rep=300)
                row["package_of_bound"] = 6 * m * kk * nn / 989e12 / (row["package_ms"] * 1e-3)
                for name, module in variants.items():
                    row[f"{name}_speedup"] = row["package_ms"] / do_bench(
                        lambda: module.launch(x, words, bias), warmup=50, rep=300
                    )
                row["partitions_same_bits"] = torch.equal(variants["partitions"].launch(x, words, bias), package)
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
