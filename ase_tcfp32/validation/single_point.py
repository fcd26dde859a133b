"""Energy, force and stress errors of each precision vs FP32 and FP64, next to FP32's noise."""

from __future__ import annotations

import numpy as np
import torch
from tqdm.auto import tqdm

from .common import calculator, environment, table, write
from .systems import water_box


def _evaluate(calc, atoms):
    atoms = atoms.copy()
    atoms.calc = calc
    return atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()


def _errors(result, reference, n_atoms):
    (e, f, s), (e0, f0, s0) = result, reference
    return {
        "energy_per_atom": abs(e - e0) / n_atoms,
        "force_max": float(np.abs(f - f0).max()),
        "force_rms": float(np.sqrt(np.mean((f - f0) ** 2))),
        "stress_max": float(np.abs(s - s0).max()),
    }


def _prefixed(prefix, result, reference, n_atoms) -> dict:
    if reference is None:
        return {}
    return {f"{prefix}_{k}": v for k, v in _errors(result, reference, n_atoms).items()}


def run(
    model: str, precisions: list[str], device=None, out="validation", engine="auto", molecules=(64, 5760), seed=0
) -> dict:
    """Single points of water boxes (``molecules`` H2O each, 1 g/cm³).

    FP32's noise floor: the largest of FP32's difference to itself on a repeat run (GPU
    atomics make repeats differ), with the atoms in reversed order (sums in another
    order), and FP32's own error against FP64 when that fits in memory (on a CPU, FP32 is
    deterministic and reordering changes few sums, so only FP64 shows its rounding noise).
    Pass: each FP32-accurate precision's force RMS difference to FP32 <= 3 x the floor.
    """
    systems = []
    for n_mol in molecules:
        atoms = water_box(n_mol, seed=seed)
        order = np.arange(len(atoms))[::-1]
        fp32 = calculator(model, "fp32", device, engine)
        ref32 = _evaluate(fp32, atoms)
        again = _evaluate(fp32, atoms)
        e_r, f_r, s_r = _evaluate(fp32, atoms[order])
        reordered = (e_r, f_r[np.argsort(order)], s_r)
        rerun, reorder = _errors(again, ref32, len(atoms)), _errors(reordered, ref32, len(atoms))
        noise = {k: max(rerun[k], reorder[k]) for k in rerun}
        try:
            ref64 = _evaluate(calculator(model, "fp64", device), atoms)
        except torch.cuda.OutOfMemoryError:  # FP64 needs twice FP32's memory
            ref64 = None
            torch.cuda.empty_cache()
        fp32_vs_fp64 = _prefixed("vs_fp64", ref32, ref64, len(atoms))
        floor = max(noise["force_rms"], fp32_vs_fp64.get("vs_fp64_force_rms", 0.0), 1e-12)
        rows = [{"precision": "fp32 noise", **{f"vs_fp32_{k}": v for k, v in noise.items()}}]
        rows.append({"precision": "fp32", **fp32_vs_fp64})
        for precision in tqdm(
            [p for p in precisions if p != "fp32"], desc=f"single points, {len(atoms)} atoms", leave=False
        ):
            result = _evaluate(calculator(model, precision, device, engine), atoms)
            row = {"precision": precision}
            row.update(_prefixed("vs_fp32", result, ref32, len(atoms)))
            row.update(_prefixed("vs_fp64", result, ref64, len(atoms)))
            if precision != "tf32":
                row["passed"] = bool(row["vs_fp32_force_rms"] <= 3 * floor)
            rows.append(row)
        systems.append({"atoms": len(atoms), "noise_floor_force_rms": floor, "rows": rows})

    figure = _plot(systems)
    results = write(
        out, "single-point", {"model": model, "environment": environment(device, engine), "systems": systems}, figure
    )
    for system in systems:
        print(f"single point, {system['atoms']} water atoms")
        print(
            table(
                system["rows"],
                [
                    ("precision", "precision", "s"),
                    ("vs_fp32_energy_per_atom", "dE/atom vs fp32", ".2e"),
                    ("vs_fp32_force_rms", "F rms vs fp32", ".2e"),
                    ("vs_fp32_force_max", "F max vs fp32", ".2e"),
                    ("vs_fp64_force_rms", "F rms vs fp64", ".2e"),
                    ("vs_fp64_stress_max", "stress vs fp64", ".2e"),
                    ("passed", "pass", ""),
                ],
            )
        )
    return results


def _plot(systems):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(systems), figsize=(5 * len(systems), 3.6), squeeze=False)
    for ax, system in zip(axes[0], systems):
        rows = system["rows"]
        labels = [r["precision"] for r in rows]
        vs32 = [r.get("vs_fp32_force_rms", np.nan) for r in rows]
        vs64 = [r.get("vs_fp64_force_rms", np.nan) for r in rows]
        x = np.arange(len(rows))
        ax.bar(x - 0.2, vs32, 0.4, label="vs FP32")
        ax.bar(x + 0.2, vs64, 0.4, label="vs FP64")
        ax.set_xticks(x, labels)
        ax.set_yscale("log")
        ax.set_ylabel("force RMS error (eV/Å)")
        ax.set_title(f"water, {system['atoms']} atoms")
        ax.legend()
    return figure
