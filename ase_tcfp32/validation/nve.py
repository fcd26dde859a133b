"""Total-energy drift of NVE velocity Verlet per precision."""

from __future__ import annotations

import numpy as np
from ase.md.velocitydistribution import Stationary, thermalize_momenta
from ase.md.verlet import VelocityVerlet
from ase.units import fs
from tqdm.auto import tqdm

from .common import calculator, environment, run_jobs, table, write
from .systems import water_box


def run(
    model: str,
    precisions: list[str],
    device=None,
    out="validation",
    engine="auto",
    ps=30.0,
    timestep_fs=0.5,
    molecules=64,
    temperature_K=300.0,
    seed=0,
    every=10,
    jobs=1,
    noise=1e-6,
) -> dict:
    """NVE of a water box (``molecules`` H2O) for ``ps`` picoseconds from the same start;
    ``jobs`` > 1 runs the trajectories in that many processes at once.

    Drift: slope of a linear fit of E_tot(t), eV/atom/ps; fluctuation: std of the residual.
    FP32's run-to-run noise: an FP32 trajectory from the start displaced by ``noise`` Å
    (a last-bit change, as a reordered sum makes); MD is chaotic, so after a few hundred fs
    it is a different trajectory with its own drift ("fp32 noise").
    Pass: |drift| <= 2 x the larger FP32 |drift| (+ twice the fit's standard error).
    """
    steps = int(round(ps * 1000 / timestep_fs))
    start = water_box(molecules, seed=seed)
    thermalize_momenta(start, temperature_K=temperature_K, rng=np.random.default_rng(seed))
    Stationary(start)
    runs = [(precision, precision, start) for precision in precisions]
    if "fp32" in precisions:
        displaced = start.copy()
        displaced.positions += np.random.default_rng(seed).normal(scale=noise, size=(len(start), 3))
        runs.insert(precisions.index("fp32") + 1, ("fp32 noise", "fp32", displaced))
    tasks = [(model, precision, device, engine, atoms, steps, timestep_fs, every) for _, precision, atoms in runs]
    traces, rows = dict(zip([name for name, _, _ in runs], run_jobs(_trajectory, tasks, jobs))), []
    for precision, (t, e) in traces.items():
        (slope, intercept), cov = (
            np.polyfit(t, e, 1, cov=True) if len(t) > 3 else ((np.nan, np.nan), np.full((2, 2), np.nan))
        )
        rows.append(
            {
                "precision": precision,
                "drift_eV_atom_ps": float(slope),
                "drift_stderr": float(np.sqrt(cov[0, 0])),
                "fluctuation_eV_atom": float(np.std(e - (slope * t + intercept))),
                "finite": bool(np.all(np.isfinite(e))),
            }
        )
    fp32_drifts = [abs(r["drift_eV_atom_ps"]) for r in rows if r["precision"] in ("fp32", "fp32 noise")]
    for row in rows:
        if fp32_drifts and row["precision"] not in ("fp32", "fp32 noise", "tf32"):
            bound = 2 * max(fp32_drifts) + 2 * row["drift_stderr"]
            row["passed"] = bool(row["finite"] and abs(row["drift_eV_atom_ps"]) <= bound)
    figure = _plot(traces)
    results = write(
        out,
        "nve",
        {
            "model": model,
            "environment": environment(device, engine),
            "atoms": len(start),
            "ps": ps,
            "timestep_fs": timestep_fs,
            "rows": rows,
            "traces": {p: {"t_ps": t.tolist(), "e_tot_eV_atom": e.tolist()} for p, (t, e) in traces.items()},
        },
        figure,
    )
    print(f"NVE, {len(start)} water atoms, {ps} ps at {timestep_fs} fs")
    print(
        table(
            rows,
            [
                ("precision", "precision", "s"),
                ("drift_eV_atom_ps", "drift (eV/atom/ps)", ".2e"),
                ("drift_stderr", "+-", ".1e"),
                ("fluctuation_eV_atom", "fluct. (eV/atom)", ".2e"),
                ("passed", "pass", ""),
            ],
        )
    )
    return results


def _trajectory(model, precision, device, engine, start, steps, timestep_fs, every) -> tuple[np.ndarray, np.ndarray]:
    """Times (ps) and total energies (eV/atom) every ``every`` steps of one NVE run."""
    atoms = start.copy()
    atoms.calc = calculator(model, precision, device, engine)
    dyn = VelocityVerlet(atoms, timestep=timestep_fs * fs)
    times, energies = [], []
    bar = tqdm(total=steps, desc=f"NVE {precision}", leave=False)

    def record():
        times.append(dyn.nsteps * timestep_fs / 1000)
        energies.append(atoms.get_total_energy() / len(atoms))
        bar.update(every if dyn.nsteps else 0)

    dyn.attach(record, interval=every)
    dyn.run(steps)
    bar.close()
    return np.array(times), np.array(energies)


def _plot(traces):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(6, 3.6))
    for precision, (t, e) in traces.items():
        ax.plot(t, e - e[0], label=precision)
    ax.set_xlabel("time (ps)")
    ax.set_ylabel("E_tot - E_tot(0) (eV/atom)")
    ax.legend()
    return figure
