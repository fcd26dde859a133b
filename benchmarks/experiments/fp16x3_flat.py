"""The fp16x3 kernel with one K loop over all of a program's output tiles, and other GEMM levers.

    python benchmarks/experiments/fp16x3_flat.py --compile     # offline, sm_90 (Triton 3.6), no GPU
    python benchmarks/experiments/fp16x3_flat.py --out ab.json # on a Hopper GPU

The package's consumers (``kernels/fp16x3.py``) run one K loop per output tile: the tile's
first K-tile is split with no wgmma in flight, and the tile's store (scale, bias, shared
memory, TMA) runs while the tensor cores idle. Here the loop runs over the K-tiles of all
of the program's tiles: when K-tile j - 1 ends a tile, j (the next tile's first) is split
while j - 1 runs and issued before the finished tile is stored, so its products run during
the store. The arithmetic (split, products, joins, their order) is the package's, so the
bits are the same (checked on every shape); only the schedule differs.

The A/B times, in one run: cuBLAS FP32 and FP16 (one pass: what three passes at cuBLAS's
own efficiency would cost), the package kernel, and the variants (other stage counts, tile
orders, BK = 64, which changes the bits: every variant's error vs FP64 is recorded). For
the lever "tuning per row count" it also times the package's tuning candidates on the rows
the autotuner uses (``autotune.tuning_rows``) and on the shape's own rows.

Measured on the H200 (``docs/design.md``, "The fp16x3 GEMM levers measured"): the flattened
loop is ~3% slower than the package on average and faster on 1 of 18 shapes per model, so
it was not adopted; the tuning candidates' winners differ by less than the run-to-run
noise; BK = 64 with 2 stages gains ~3% on average, not on every shape (``--no-tuning
--variants "package;package, BK 64, 2 stages;flat, BK 64, 2 stages;flat"``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma_wait

from ase_tcfp32._kernels import autotune, fp16x3
from ase_tcfp32._kernels.context import on_device
from ase_tcfp32._kernels.fp16x3 import _issue, _loader, _split
from ase_tcfp32._kernels.gluon_common import descriptor, ring, tile_offsets, tma_ready
from ase_tcfp32._kernels.triton_gemm import sm_count


@gluon.jit
def _store_tile(
    acc, ys, y_desc, scale_ptr, bias_ptr, N, off_m, off_n, cols_layout: gl.constexpr, HAS_BIAS: gl.constexpr
):
    """``acc * scale (+ bias)`` into shared memory ``ys``, from where a TMA store writes
    the output tile at (off_m, off_n) while the consumers go on (TMA clips rows and
    columns past M, N)."""
    BN: gl.constexpr = ys.shape[1]
    cols = off_n + gl.arange(0, BN, layout=cols_layout)
    acc = acc * gl.expand_dims(gl.load(scale_ptr + cols, mask=cols < N, other=0.0), 0)
    if HAS_BIAS:
        acc = acc + gl.expand_dims(gl.load(bias_ptr + cols, mask=cols < N, other=0.0), 0)
    tma.store_wait(pendings=0)  # the previous tile has left ys
    gl.thread_barrier()
    ys.store(acc)
    fence_async_shared()
    tma.async_copy_shared_to_global(y_desc, [off_m, off_n], ys)


@gluon.jit
def _flat_consumer(
    xs,
    his,
    los,
    ready,
    empty,
    ys,
    y_desc,
    scale_ptr,
    bias_ptr,
    M,
    N,
    num_k,
    HAS_BIAS: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Consumer warpgroups: K-tile j is split while j - 1 runs; j - 1 joins the FP32 sum
    with no wgmma in flight, j is issued, and when j - 1 ended a tile, that tile is stored."""
    BM: gl.constexpr = xs.shape[1]
    BN: gl.constexpr = his.shape[1]
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma)
    cols_layout: gl.constexpr = gl.SliceLayout(0, mma)
    zero = gl.zeros((BM, BN), gl.float32, mma)
    first, step = gl.program_id(0), gl.num_programs(0)
    total = gl.cdiv(gl.cdiv(M, BM) * gl.cdiv(N, BN) - first, step) * num_k  # K-tiles of this program
    acc = zero
    mbarrier.wait(ready.index(0), 0)
    hi, lo, hi_c, down = _split(xs.index(0), a_layout, rows_layout)
    pending = _issue(hi, lo, hi_c, his.index(0), los.index(0), zero)
    for j in range(1, total):
        s = j % STAGES
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        next_hi, next_lo, next_hi_c, next_down = _split(xs.index(s), a_layout, rows_layout)
        prev, hi, lo, hi_c = warpgroup_mma_wait(num_outstanding=0, deps=(pending, hi, lo, hi_c))
        mbarrier.arrive(empty.index((j + STAGES - 1) % STAGES), count=1)
        acc = acc + prev * gl.expand_dims(down, 1)
        pending = _issue(next_hi, next_lo, next_hi_c, his.index(s), los.index(s), prev)
        hi, lo, hi_c, down = next_hi, next_lo, next_hi_c, next_down
        if j % num_k == 0:  # j - 1 ended a tile
            off_m, off_n = tile_offsets(M, N, BM, BN, GROUP_M, first + (j // num_k - 1) * step)
            _store_tile(acc, ys, y_desc, scale_ptr, bias_ptr, N, off_m, off_n, cols_layout, HAS_BIAS)
            acc = zero
    prev, hi, lo, hi_c = warpgroup_mma_wait(num_outstanding=0, deps=(pending, hi, lo, hi_c))
    mbarrier.arrive(empty.index((total + STAGES - 1) % STAGES), count=1)
    acc = acc + prev * gl.expand_dims(down, 1)
    off_m, off_n = tile_offsets(M, N, BM, BN, GROUP_M, first + (total // num_k - 1) * step)
    _store_tile(acc, ys, y_desc, scale_ptr, bias_ptr, N, off_m, off_n, cols_layout, HAS_BIAS)
    tma.store_wait(pendings=0)


@gluon.jit
def _flat_kernel(
    x_desc,
    hi_desc,
    lo_desc,
    y_desc,
    scale_ptr,
    bias_ptr,
    M,
    N,
    HAS_BIAS: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The package's ``_fp16x3_kernel`` with :func:`_flat_consumer` (same producer, ring)."""
    xs, his, los, ready, empty = ring(x_desc, hi_desc, lo_desc, STAGES)
    ys = gl.allocate_shared_memory(gl.float32, y_desc.block_type.shape, y_desc.layout)
    num_k = gl.cdiv(x_desc.shape[1], x_desc.block_type.shape[1])
    gl.warp_specialize(
        [
            (
                _flat_consumer,
                (
                    xs,
                    his,
                    los,
                    ready,
                    empty,
                    ys,
                    y_desc,
                    scale_ptr,
                    bias_ptr,
                    M,
                    N,
                    num_k,
                    HAS_BIAS,
                    GROUP_M,
                    STAGES,
                    num_warps,
                ),
            ),
            (_loader, (x_desc, hi_desc, lo_desc, xs, his, los, ready, empty, M, N, GROUP_M, STAGES)),
        ],
        [1],
        [24],
    )


def launch(x: torch.Tensor, w: fp16x3.Words, config: dict) -> torch.Tensor:
    """``x [M, K] @ w^T`` (M, K > 0) as the package's ``fp16x3.launch``, through :func:`_flat_kernel`."""
    m, _ = x.shape
    _, n, kp = w.words.shape
    y = torch.empty((m, -(-n // 4) * 4), device=x.device, dtype=torch.float32)
    bm, bn, bk = config["BM"], config["BN"], config["BK"]
    tiles = -(-m // bm) * -(-n // bn)
    with on_device(x.device):
        _flat_kernel[(min(tiles, sm_count(x.device)),)](
            descriptor(tma_ready(x, kp), [bm, bk]),
            descriptor(w.words[0], [bn, bk]),
            descriptor(w.words[1], [bn, bk]),
            descriptor(y, [bm, bn]),
            w.scale,
            y,
            m,
            n,
            HAS_BIAS=False,
            STAGES=config["STAGES"],
            GROUP_M=config["GROUP_M"],
            num_warps=config["num_warps"],
        )
    return y if y.shape[1] == n else y[:, :n].contiguous()


VARIANTS = {
    "package": (fp16x3.launch, {}),
    "flat": (launch, {}),
    "flat, 3 stages": (launch, dict(STAGES=3)),
    "flat, 5 stages": (launch, dict(STAGES=5)),
    "flat, GROUP_M 4": (launch, dict(GROUP_M=4)),
    "flat, GROUP_M 16": (launch, dict(GROUP_M=16)),
    "flat, BK 64, 2 stages": (launch, dict(BK=64, STAGES=2)),
    "package, BK 64, 2 stages": (fp16x3.launch, dict(BK=64, STAGES=2)),
}
"""Name: (launcher, changes to ``fp16x3.CONFIG``); the first is the reference for the bits."""


def compile_offline() -> None:
    """Compile the package kernel and :func:`_flat_kernel` for sm_90 and print their structure."""
    sys.path.insert(0, str(Path(__file__).parent))
    from compile_sm90 import compile_fp16x3, structure

    for name, kernel, bk, stages in [
        ("package", fp16x3._fp16x3_kernel, 32, 4),
        ("flat", _flat_kernel, 32, 4),
        ("flat", _flat_kernel, 64, 2),
        ("package", fp16x3._fp16x3_kernel, 64, 2),
    ]:
        compiled = compile_fp16x3(kernel, dict(fp16x3.CONFIG, BK=bk, STAGES=stages))
        print(f"{name}, BK={bk}, {stages} stages:", structure(compiled), flush=True)


def ab(models: list[str], atoms: int, variants: list[str], tuning: bool) -> dict:
    """Every variant on every PET shape of ``models`` at ``atoms``, forward (x w^T) and
    backward (dy w), with cuBLAS FP32 and FP16 of the same run; speed-ups printed."""
    from triton.testing import do_bench

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from gemm import environment, pet_shapes

    results = {"environment": environment(), "atoms": atoms, "shapes": []}
    for model in models:
        for layer, m, k, n in pet_shapes(model, atoms):
            g = torch.Generator(device="cuda").manual_seed(m + k + n)
            x = torch.randn(m, k, device="cuda", generator=g)
            w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
            dy = torch.randn(m, n, device="cuda", generator=g)
            row = {"model": model, "layer": layer, "M": m, "K": k, "N": n}
            row["cublas_fp32_ms"] = [
                do_bench(lambda: x @ w.T, return_mode="median"),
                do_bench(lambda: dy @ w, return_mode="median"),
            ]
            xh, wh, dyh = x.half(), w.half(), dy.half()
            row["cublas_fp16_ms"] = [
                do_bench(lambda: xh @ wh.T, return_mode="median"),
                do_bench(lambda: dyh @ wh, return_mode="median"),
            ]
            head = slice(0, 16384)
            exact = (x[head].double() @ w.double().T, dy[head].double() @ w.double())
            forward, backward = fp16x3.split_weight(w), fp16x3.split_weight(w.T.contiguous())
            reference = None
            for name in variants:
                run, changes = VARIANTS[name]
                config = dict(fp16x3.CONFIG, **changes)
                outputs = (run(x, forward, config=config), run(dy, backward, config=config))
                reference = reference or outputs
                row[name] = {
                    "ms": [
                        do_bench(lambda: run(x, forward, config=config), return_mode="median"),
                        do_bench(lambda: run(dy, backward, config=config), return_mode="median"),
                    ],
                    "same_bits": [torch.equal(o, r) for o, r in zip(outputs, reference)],
                    "error_vs_fp64": [
                        ((o[head].double() - e).norm() / e.norm()).item() for o, e in zip(outputs, exact)
                    ],
                }
            fp32 = row["cublas_fp32_ms"]
            cells = [f"cuBLAS FP16 {fp32[0] / row['cublas_fp16_ms'][0]:.1f}/{fp32[1] / row['cublas_fp16_ms'][1]:.1f}x"]
            cells += [
                f"{name} {fp32[0] / row[name]['ms'][0]:.2f}/{fp32[1] / row[name]['ms'][1]:.2f}x"
                + ("" if all(row[name]["same_bits"]) else " (other bits)")
                for name in variants
            ]
            if tuning:
                rows = autotune.tuning_rows(n, k)
                row["tuning"] = {"tuning_rows": rows, "candidates": fp16x3.CANDIDATES, "ms": {}}
                for label, operands in [("tuning rows", (x[:rows], dy[:rows])), ("all rows", (x, dy))]:
                    row["tuning"]["ms"][label] = [
                        [
                            do_bench(lambda: fp16x3.launch(a, words, config=c), return_mode="median")
                            for c in fp16x3.CANDIDATES
                        ]
                        for a, words in zip(operands, (forward, backward))
                    ]
                chosen = {
                    label: [min(range(len(t)), key=t.__getitem__) for t in times]
                    for label, times in row["tuning"]["ms"].items()
                }
                cells.append(
                    f"tuning candidate fwd/bwd on {rows} rows {chosen['tuning rows']}, on all {chosen['all rows']}"
                )
            print(f"{model} {layer:26} {m}x{k}x{n}:", "; ".join(cells), flush=True)
            results["shapes"].append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="compile for sm_90 offline and print the structure")
    parser.add_argument("--models", default="s,m")
    parser.add_argument("--atoms", type=int, default=17280)
    parser.add_argument("--out", default=None, help="write the A/B as JSON here")
    parser.add_argument(
        "--variants",
        default=";".join(VARIANTS),
        help="which of VARIANTS, ';'-separated (the first is the bits' reference)",
    )
    parser.add_argument("--no-tuning", action="store_true", help="skip the tuning candidates")
    args = parser.parse_args()
    if args.compile:
        compile_offline()
        return
    variants = args.variants.split(";")
    if unknown := [name for name in variants if name not in VARIANTS]:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    results = ab(args.models.split(","), args.atoms, variants, not args.no_tuning)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
