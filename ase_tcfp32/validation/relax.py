"""FIRE relaxation of a Cantor-alloy slab per precision: steps, final fmax, time per step."""

from __future__ import annotations

import time

import numpy as np
from ase.optimize import FIRE
from tqdm.auto import tqdm

from .common import calculator, environment, run_jobs, table, write
from .systems import cantor_slab


def run(
    model: str,
    precisions: list[str],
    device=None,
    out="validation",
    engine="auto",
    fmax=1e-3,
    max_steps=500,
    repeats=3,
    size=(7, 7, 11),
    rattle=0.05,
    jobs=1,
) -> dict:
    """FIRE to ``fmax`` eV/Å (at most ``max_steps``) from ``repeats`` seeded starts
    (species arrangement and a ``rattle`` Å displacement per seed); ``jobs`` > 1 runs
    that many relaxations at once in separate processes.

    Pass: converged in every repeat, and mean steps within 2% of FP32's. No verdict
    (``passed`` None) when FP32 itself does not converge in every repeat within
    ``max_steps``: then nothing says how many steps a converged run takes.
    """
    tasks = [
        (model, p, device, engine, seed, size, rattle, fmax, max_steps) for p in precisions for seed in range(repeats)
    ]
    done = iter(run_jobs(_relax, tasks, jobs))
    runs, rows = {p: [next(done) for _ in range(repeats)] for p in precisions}, []
    for precision in precisions:
        r = runs[precision]
        rows.append(
            {
                "precision": precision,
                "steps": float(np.mean([x["steps"] for x in r])),
                "converged": f"{sum(x['converged'] for x in r)}/{len(r)}",
                "final_fmax": max(x["final_fmax"] for x in r),
                "ms_per_step": 1000 * float(np.median([x["s_per_step"] for x in r])),
            }
        )
    reference = next((r for r in rows if r["precision"] == "fp32"), None)
    judged = reference is not None and all(x["converged"] for x in runs["fp32"])
    for row in rows:
        if reference and row["precision"] not in ("fp32", "tf32"):
            all_converged = all(x["converged"] for x in runs[row["precision"]])
            close = abs(row["steps"] - reference["steps"]) <= 0.02 * reference["steps"]
            row["passed"] = bool(all_converged and close) if judged else None
    figure = _plot(runs)
    n_atoms = len(cantor_slab(size=size))
    results = write(
        out,
        "relax",
        {
            "model": model,
            "environment": environment(device, engine),
            "atoms": n_atoms,
            "fmax": fmax,
            "max_steps": max_steps,
            "rows": rows,
            "runs": runs,
        },
        figure,
    )
    print(f"FIRE relaxation, Cantor-alloy slab of {n_atoms} atoms, fmax {fmax} eV/Å, {repeats} repeats")
    print(
        table(
            rows,
            [
                ("precision", "precision", "s"),
                ("steps", "mean steps", ".1f"),
                ("converged", "converged", "s"),
                ("final_fmax", "final fmax", ".2e"),
                ("ms_per_step", "ms/step", ".1f"),
                ("passed", "pass", ""),
            ],
        )
    )
    if reference and not judged:
        print(f"no verdict: FP32 did not converge within {max_steps} steps (raise --relax-steps)")
    return results


def _relax(model, precision, device, engine, seed, size, rattle, fmax, max_steps) -> dict:
    """One FIRE relaxation: steps, convergence, final fmax, seconds per step, fmax trace."""
    atoms = cantor_slab(size=size, seed=seed)
    atoms.rattle(rattle, seed=seed)
    atoms.calc = calculator(model, precision, device, engine)
    trace = []
    opt = FIRE(atoms, logfile=None)
    opt.attach(lambda: trace.append(float(np.linalg.norm(atoms.get_forces(), axis=1).max())))
    bar = tqdm(total=max_steps + 1, desc=f"FIRE {precision} #{seed}", leave=False)
    opt.attach(lambda: bar.update(1))
    start = time.perf_counter()
    converged = opt.run(fmax=fmax, steps=max_steps)
    elapsed = time.perf_counter() - start
    bar.close()
    return {
        "seed": seed,
        "steps": opt.nsteps,
        "converged": bool(converged),
        "final_fmax": trace[-1],
        "s_per_step": elapsed / max(1, opt.nsteps),
        "fmax_trace": trace,
    }


def _plot(runs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(6, 3.6))
    for i, (precision, r) in enumerate(runs.items()):
        for j, x in enumerate(r):
            ax.semilogy(x["fmax_trace"], color=f"C{i}", alpha=0.8, label=precision if j == 0 else None)
    ax.set_xlabel("FIRE step")
    ax.set_ylabel("max |F| (eV/Å)")
    ax.legend()
    return figure
