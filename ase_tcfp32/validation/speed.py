"""Time per MD step (energy + forces) per precision, against FP32 in the same run."""

from __future__ import annotations

import time

import numpy as np
import torch
from tqdm.auto import tqdm

from .common import calculator, environment, table, write
from .systems import water_box


def _step_times(calc, atoms, warmup: int, repeats: int, device) -> list[float]:
    """Seconds per energy+forces call on slightly moved copies (no cached result)."""
    rng = np.random.default_rng(0)
    atoms = atoms.copy()
    atoms.calc = calc
    cuda = calc.device.type == "cuda"
    times = []
    for i in range(warmup + repeats):
        atoms.positions += rng.normal(scale=1e-3, size=atoms.positions.shape)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            atoms.get_forces()
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end) / 1000
        else:
            t0 = time.perf_counter()
            atoms.get_forces()
            elapsed = time.perf_counter() - t0
        if i >= warmup:
            times.append(elapsed)
    return times


def run(
    model: str,
    precisions: list[str],
    device=None,
    out="validation",
    engine="auto",
    molecules=(64, 5760),
    warmup=3,
    repeats=10,
) -> dict:
    """Median time per energy+forces call of water boxes; speed-up vs FP32 of the same run."""
    systems = []
    for n_mol in molecules:
        atoms = water_box(n_mol, seed=0)
        rows = []
        for precision in tqdm(precisions, desc=f"speed, {len(atoms)} atoms", leave=False):
            calc = calculator(model, precision, device, engine)
            if calc.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times = _step_times(calc, atoms, warmup, repeats, device)
            row = {
                "precision": precision,
                "backend": calc.backend,
                "ms": 1000 * float(np.median(times)),
                "ms_min": 1000 * float(np.min(times)),
            }
            if calc.device.type == "cuda":
                row["peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
            rows.append(row)
            del calc
        base = next((r["ms"] for r in rows if r["precision"] == "fp32"), None)
        for row in rows:
            row["speedup"] = base / row["ms"] if base else None
        systems.append({"atoms": len(atoms), "rows": rows})
    figure = _plot(systems)
    results = write(
        out,
        "speed",
        {
            "model": model,
            "environment": environment(device, engine),
            "warmup": warmup,
            "repeats": repeats,
            "systems": systems,
        },
        figure,
    )
    for system in systems:
        print(f"speed, {system['atoms']} water atoms (median of {repeats})")
        print(
            table(
                system["rows"],
                [
                    ("precision", "precision", "s"),
                    ("backend", "backend", "s"),
                    ("ms", "ms/step", ".2f"),
                    ("speedup", "vs fp32", ".2f"),
                    ("peak_GB", "peak GB", ".1f"),
                ],
            )
        )
    return results


def _plot(systems):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(systems), figsize=(4.5 * len(systems), 3.4), squeeze=False)
    for ax, system in zip(axes[0], systems):
        ax.bar([r["precision"] for r in system["rows"]], [r["ms"] for r in system["rows"]])
        ax.set_ylabel("ms per energy+forces")
        ax.set_title(f"water, {system['atoms']} atoms")
    return figure
