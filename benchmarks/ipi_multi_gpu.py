"""i-PI path-integral MD over several GPUs of one host: bead-steps per second on 1, 2, 4 GPUs.

    python benchmarks/ipi_multi_gpu.py [--gpus 1,2,4] [--systems 64:32,5760:8] [--out FILE.json]
    python benchmarks/ipi_multi_gpu.py --gpus 2 --same-gpu   # two drivers on GPU 0 (a one-GPU test)

For each GPU count G and system (water molecules : beads), two layouts of the same i-PI
server (``benchmarks/ipi.py``'s :func:`run`, default precision and engine, PET-S-shaped
random weights): G driver processes, one per GPU (``CUDA_VISIBLE_DEVICES``), each taking
batches of beads / G structures; and one driver with ``device="cuda:0;...;cuda:G-1"``
splitting batches of all the beads across the GPUs (one thread per GPU). No NCCL is used.
Speed-ups are against G = 1 in the same run, from the mean step.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("ipi_benchmark", Path(__file__).with_name("ipi.py"))
ipi_benchmark = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ipi_benchmark)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="1,2,4")
    parser.add_argument("--systems", default="64:32,5760:8", help="water molecules:beads, comma-separated")
    parser.add_argument("--model", default="s")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--same-gpu", action="store_true", help="every driver on GPU 0 (to test on one GPU)")
    parser.add_argument(
        "--out", default=None, help="results file (default: benchmarks/results/ipi_multi_gpu_<gpu>.json)"
    )
    args = parser.parse_args()

    import _results
    import torch

    from ase_tcfp32.testing import random_checkpoint
    from ase_tcfp32.validation import water_box

    model = str(random_checkpoint(args.model))
    available = torch.cuda.device_count()
    rows = []
    for system in args.systems.split(","):
        molecules, beads = map(int, system.split(":"))
        water = water_box(molecules, seed=0)
        base = {}
        for gpus in map(int, args.gpus.split(",")):
            if gpus > available and not args.same_gpu:
                print(f"{gpus} GPUs asked, {available} here: skipped")
                continue
            ids = [0] * gpus if args.same_gpu else list(range(gpus))
            layouts = {
                "driver per GPU": ([{"env": {"CUDA_VISIBLE_DEVICES": str(i)}} for i in ids], max(1, beads // gpus)),
                "one driver, split batch": ([{"device": ";".join(f"cuda:{i}" for i in ids)}], beads),
            }
            for layout, (drivers, batch) in layouts.items():
                if gpus == 1 and layout != "driver per GPU":
                    continue  # the same run as the other layout
                row = {
                    "atoms": len(water),
                    "beads": beads,
                    "gpus": gpus,
                    "layout": layout,
                    "batch_size": batch,
                    "same_gpu": args.same_gpu,
                }
                try:
                    row.update(
                        ipi_benchmark.run(
                            model, water, beads=beads, steps=args.steps, warmup=2, batch_size=batch, drivers=drivers
                        )
                    )
                    row["bead_steps_per_s"] = beads * 1000 / row["ms_per_step_mean"]
                    if gpus == 1:
                        base[1] = row["bead_steps_per_s"]
                    row["speedup_vs_1_gpu"] = row["bead_steps_per_s"] / base[1] if 1 in base else None
                    print(
                        f"{len(water):>6} atoms x {beads:>2} beads, {gpus} GPU(s), {layout:>24}: "
                        f"{row['ms_per_step_mean']:8.1f} ms/step (mean), {row['bead_steps_per_s']:8.1f} bead-steps/s, "
                        f"x{row['speedup_vs_1_gpu'] or float('nan'):.2f}",
                        flush=True,
                    )
                except Exception as error:
                    row["error"] = str(error)[-1500:]
                    print(f"{len(water)} atoms, {gpus} GPU(s), {layout}: failed: {row['error'][-300:]}", flush=True)
                rows.append(row)
                env = {**_results.environment(), "gpus_available": available}
                _results.write(
                    "ipi_multi_gpu", rows, ("atoms", "beads", "gpus", "layout", "same_gpu"), env=env, out=args.out
                )


if __name__ == "__main__":
    main()
