"""How close to the conservative forces must the direct ones be for multiple time stepping to conserve energy?

    python scripts/demo_model/mts_sensitivity.py --alphas vv,1,0.5,0.25 --inner-steps 8 --ps 0.5 --out mts.json
    python scripts/demo_model/mts_sensitivity.py --alphas vv,1 --inner-steps 16 --timestep-fs 0.25 --out mts.json

An experiment, not part of the recipe (docs/demo_model.md, "Direct force and stress heads").
The 192-atom water box of ``evaluate.py``'s ``mts`` part, 0.5 fs inner steps, started near
equilibrium at ~300 K (``--start relaxed``, the default: ``evaluate.py``'s
``relaxed_water_at_300_k``) or as built (``--start hot``: its relaxation heats it to ~550 K
within 0.5 ps). Each ``--alphas`` entry is one run: ``vv``, velocity Verlet on the
conservative forces (the reference); ``1``, :class:`ase_tcfp32.mts.MTSVelocityVerlet` with
the bundled model's direct forces; any other ``alpha``, the same integrator with direct
forces ``F_c + alpha (F_d - F_c)``: heads ``alpha`` times as far from the conservative forces,
with the same error pattern (these need the conservative forces at every inner step too, so
they cost what velocity Verlet costs). Writes, per run, the total-energy drift (eV/ps, a
straight line's slope), its span (eV) and the final temperature. ``--langevin 1,4,8``: then
:class:`ase_tcfp32.mts.MTSLangevin` at 300 K (friction 0.01/fs) for each M, the mean and
spread of the temperature over the second half of the run (does a thermostat absorb the
heating?).

    python scripts/demo_model/mts_sensitivity.py --plot docs/images/mts_sensitivity.png

draws the drift against the direct forces' error from the ``mts_sensitivity`` runs of
``docs/demo_model.json`` (the model card's figure) and runs nothing.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from ase.md.verlet import VelocityVerlet
from ase.units import fs

sys.path.insert(0, str(Path(__file__).parent))

from evaluate import energy_drift, relaxed_water_at_300_k, water_at_300_k  # noqa: E402

from ase_tcfp32 import TCPETCalculator  # noqa: E402
from ase_tcfp32.mts import BOTH, MTSLangevin, MTSVelocityVerlet  # noqa: E402


class ScaledDirectMTS(MTSVelocityVerlet):
    """:class:`MTSVelocityVerlet` with direct forces ``F_c + alpha (F_d - F_c)`` (through ASE)."""

    def __init__(self, atoms, timestep, inner_steps, alpha: float):
        self.alpha = alpha
        super().__init__(atoms, timestep, inner_steps, device_inner_steps=False, energy_drift_warning=None)

    def outer_forces(self):
        conservative, direct = super().outer_forces()
        return conservative, conservative + self.alpha * (direct - conservative)

    def direct_forces(self):
        (result,) = self._calculator().evaluate([self.atoms], list(BOTH))
        conservative = result["forces"]
        return conservative + self.alpha * (result["non_conservative_forces"] - conservative)


def run(start, ps: float, inner_steps: int, alpha: float | None, timestep_fs: float = 0.5) -> dict:
    """Drift, span and final temperature of one run from a copy of ``start`` (``alpha`` None:
    velocity Verlet; 1: :class:`MTSVelocityVerlet` itself, direct forces alone in the inner
    steps), with inner steps of ``timestep_fs``."""
    atoms = start.copy()
    atoms.calc = start.calc
    dt = timestep_fs * fs
    if alpha is None:
        dyn = VelocityVerlet(atoms, dt)
    elif alpha == 1:
        dyn = MTSVelocityVerlet(atoms, dt, inner_steps, energy_drift_warning=None)
    else:
        dyn = ScaledDirectMTS(atoms, dt, inner_steps, alpha)
    inner = 1 if alpha is None else inner_steps
    return {"alpha": alpha, "inner_steps": inner, "timestep_fs": timestep_fs, **energy_drift(dyn, ps)}


def thermostatted(start, ps: float, inner_steps: int, timestep_fs: float = 0.5) -> dict:
    """:class:`MTSLangevin` (300 K, friction 0.01/fs, inner steps of ``timestep_fs``) from a copy of
    ``start`` with the bundled model's direct forces: the mean and spread of the temperature over
    the run's second half."""
    atoms = start.copy()
    atoms.calc = start.calc
    dyn = MTSLangevin(atoms, timestep_fs * fs, 300, 0.01 / fs, inner_steps, rng=np.random.default_rng(0))
    t, temperatures = [], []
    dyn.attach(lambda: (t.append(dyn.get_time() / (1000 * fs)), temperatures.append(atoms.get_temperature())))
    dyn.run(round(ps * 1000 * fs / dyn.dt))
    late = np.array(temperatures)[np.array(t) >= ps / 2]
    return {
        "thermostat": "langevin 300 K, 0.01/fs",
        "inner_steps": inner_steps,
        "timestep_fs": timestep_fs,
        "ps": ps,
        "T_mean_second_half_K": float(late.mean()),
        "T_std_second_half_K": float(late.std()),
    }


def plot(card: Path, out: Path, water_rms_mev: float = 139.9) -> None:
    """Drift (eV/ps) against the direct forces' RMS distance from the conservative ones on
    water (``alpha`` times ``water_rms_mev``, meV/Å), from the card's ``mts_sensitivity``
    runs, with velocity Verlet's drift and twice it as lines; written to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = json.loads(card.read_text())["mts_sensitivity"]["runs"]
    verlet = next(r["drift_eV_ps"] for r in runs if r["alpha"] is None)
    scaled = sorted((r["alpha"] * water_rms_mev, r["drift_eV_ps"]) for r in runs if r["alpha"] is not None)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    ax.loglog(*zip(*scaled), "o-", label="MTS, M = 8 (direct forces scaled)")
    ax.annotate("the shipped heads", scaled[-1], xytext=(-100, -4), textcoords="offset points", fontsize=8)
    ax.axhline(verlet, color="k", lw=1, label="velocity Verlet")
    ax.axhline(2 * verlet, color="k", lw=1, ls="--", label="twice velocity Verlet")
    ax.set_xlabel("direct minus conservative forces on water (meV/Å RMS)")
    ax.set_ylabel("total-energy drift (eV/ps)")
    ax.set_title("192 water atoms, 0.5 fs inner steps, 0.5 ps from ~300 K", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--alphas", default="vv,1,0.5,0.25", help="comma-separated; 'vv' for velocity Verlet ('': none)"
    )
    parser.add_argument("--inner-steps", type=int, default=8)
    parser.add_argument(
        "--timestep-fs", type=float, default=0.5, help="the inner step (velocity Verlet's and Langevin's too)"
    )
    parser.add_argument("--ps", type=float, default=0.5)
    parser.add_argument("--start", choices=("hot", "relaxed"), default="relaxed")
    parser.add_argument("--langevin", default="", help="comma-separated M: MTSLangevin runs (300 K) after the others")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", help="results file (JSON)")
    parser.add_argument("--plot", help="draw the card's figure into this PNG from docs/demo_model.json, run nothing")
    args = parser.parse_args()
    if args.plot:
        plot(Path(__file__).parents[2] / "docs" / "demo_model.json", Path(args.plot))
        return
    if not args.out:
        parser.error("--out is required to run")
    calc = TCPETCalculator("pet-demo-chgnet", precision="fp32", device=args.device, uncertainty_threshold=None)
    start = relaxed_water_at_300_k(calc) if args.start == "relaxed" else water_at_300_k(calc)
    rows = []
    for alpha in filter(None, args.alphas.split(",")):
        rows.append(
            {
                "start": args.start,
                **run(start, args.ps, args.inner_steps, None if alpha == "vv" else float(alpha), args.timestep_fs),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    for inner in filter(None, args.langevin.split(",")):
        rows.append({"start": args.start, **thermostatted(start, args.ps, int(inner), args.timestep_fs)})
        print(json.dumps(rows[-1]), flush=True)
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
