"""Smoothness of a CO/Pt(111) pull-off energy curve per precision."""

from __future__ import annotations

import numpy as np
from tqdm.auto import tqdm

from .common import calculator, environment, table, write
from .systems import co_on_pt111


def roughness(energies: np.ndarray, exact: np.ndarray) -> float:
    """RMS second difference (eV) of ``energies - exact`` along the curve.

    ``exact`` is the same model in FP64: subtracting it removes the model's own shape,
    and the second difference keeps the point-to-point noise the arithmetic adds
    (single-pass TF32 shows it, FP32 has its rounding noise as a floor).
    """
    return float(np.sqrt(np.mean(np.diff(energies - exact, 2) ** 2)))


def run(
    model: str,
    precisions: list[str],
    device=None,
    out="validation",
    engine="auto",
    start=1.2,
    step=0.081,
    points=60,
    size=(3, 3, 4),
) -> dict:
    """Pull CO rigidly from ``start`` Å above the top Pt in ``points`` steps of ``step`` Å.

    Pass: each FP32-accurate precision's roughness (against FP64) <= 2 x FP32's.
    """
    heights = start + step * np.arange(points)
    slab = co_on_pt111(start, size=size)
    carbon = len(slab) - 2
    curves = {}
    for precision in ["fp64", *precisions]:
        calc = calculator(model, precision, device, engine)
        energies = []
        for h in tqdm(heights, desc=f"CO pull-off, {precision}", leave=False):
            atoms = slab.copy()
            atoms.positions[carbon:, 2] += h - start
            atoms.calc = calc
            energies.append(atoms.get_potential_energy())
        curves[precision] = np.array(energies)
    exact = curves.pop("fp64")
    rows = []
    reference = roughness(curves["fp32"], exact) if "fp32" in curves else None
    for precision, energies in curves.items():
        row = {"precision": precision, "roughness": roughness(energies, exact)}
        if reference is not None:
            row["max_dev_from_fp32"] = float(np.abs(energies - curves["fp32"]).max())
            if precision not in ("fp32", "tf32"):
                row["passed"] = bool(row["roughness"] <= 2 * reference)
        rows.append(row)
    figure = _plot(heights, curves, exact)
    results = write(
        out,
        "smoothness",
        {
            "model": model,
            "environment": environment(device, engine),
            "heights": heights.tolist(),
            "energies": {p: e.tolist() for p, e in curves.items()},
            "energies_fp64": exact.tolist(),
            "rows": rows,
        },
        figure,
    )
    print(f"CO/Pt(111) pull-off, {len(slab)} atoms, {points} heights")
    print(
        table(
            rows,
            [
                ("precision", "precision", "s"),
                ("roughness", "roughness vs fp64 (eV)", ".2e"),
                ("max_dev_from_fp32", "max |E - E_fp32| (eV)", ".2e"),
                ("passed", "pass", ""),
            ],
        )
    )
    return results


def _plot(heights, curves, exact):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
    for precision, energies in curves.items():
        top.plot(heights, energies - energies[-1], label=precision)
        bottom.plot(heights, energies - exact, label=precision)
    top.set_ylabel("E - E(far) (eV)")
    top.legend()
    bottom.set_ylabel("E - E_fp64 (eV)")
    bottom.set_xlabel("C height above top Pt (Å)")
    bottom.legend()
    return figure
