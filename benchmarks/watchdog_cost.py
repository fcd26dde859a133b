"""What the accuracy watchdog costs and whether it stays quiet on PET, per MD step.

    python benchmarks/watchdog_cost.py [--model s] [--molecules 5760] [--steps 5] [--out FILE.json]

ASE velocity Verlet of a water box with the default calculator (PET-MAD-shaped random
weights), once with the watchdog off and once checking every evaluation
(``check_accuracy=1``); prints the median ms per step of both, the number of
``PrecisionWarning`` raised, and the cost at the calculator's default interval,
``(checked - unchecked) / unchecked / watchdog.CALCULATOR_EVERY``.
"""

from __future__ import annotations

import argparse
import json
import warnings

import _results
import numpy as np
from _timing import md_step_times
from ase.md.verlet import VelocityVerlet
from ase.units import fs

from ase_tcfp32 import PrecisionWarning, TCPETCalculator, watchdog
from ase_tcfp32.testing import random_checkpoint
from ase_tcfp32.validation import water_box


def steps_ms(model: str, atoms, every: int, steps: int) -> tuple[float, int]:
    atoms = atoms.copy()
    atoms.calc = TCPETCalculator(model, check_accuracy=every)
    dyn = VelocityVerlet(atoms, 0.25 * fs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PrecisionWarning)
        dyn.run(2)
        times = md_step_times(dyn, steps)
    return 1000 * float(np.median(times)), sum(issubclass(w.category, PrecisionWarning) for w in caught)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="s")
    parser.add_argument("--molecules", type=int, default=5760)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--out", default=None, help="results file (default: benchmarks/results/watchdog_cost_<gpu>.json)"
    )
    args = parser.parse_args()
    model, atoms = str(random_checkpoint(args.model)), water_box(args.molecules, seed=0)
    off, _ = steps_ms(model, atoms, 0, args.steps)
    every, warned = steps_ms(model, atoms, 1, args.steps)
    row = {
        "model": f"random-{args.model}",
        "atoms": len(atoms),
        "ms_unchecked": off,
        "ms_every_step_checked": every,
        "precision_warnings": warned,
        "default_every": watchdog.CALCULATOR_EVERY,
        "cost_at_default": (every - off) / off / watchdog.CALCULATOR_EVERY,
    }
    print(json.dumps(row, indent=1))
    _results.write("watchdog_cost", [row], ("model", "atoms"), out=args.out)


if __name__ == "__main__":
    main()
