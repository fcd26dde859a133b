"""Frames of the demo model's own FIRE relaxations of Cantor-alloy slabs, labelled by the teacher.

    TEACHER_PYTHON scripts/demo_model/relax_frames.py --model build/demo-model/stage2.ckpt \
        --out build/demo-model/relax.xyz          # teacher environment (chgnet installed)

A model trained on MD snapshots and rattled cells can still be wrong on the paths a
relaxation takes (surface atoms moving far from the bulk-like sites it has seen). This
runs FIRE with the model from slabs of the validation builder (seeds distinct from the
validation suite's 0-2), keeps a frame every ``--every`` steps, and labels the frames
with the teacher, for a further fine-tuning stage (active learning, one round).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from ase.io import write
from ase.optimize import FIRE

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32.validation import cantor_slab

sys.path.insert(0, str(Path(__file__).parents[1]))
from make_dataset import label, teacher  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", default="100,101")
    parser.add_argument("--size", default="7,7,11")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100)
    args = parser.parse_args()
    student = TCPETCalculator(args.model, precision="fp32", device="cpu")
    frames = []
    for seed in map(int, args.seeds.split(",")):
        atoms = cantor_slab(size=tuple(map(int, args.size.split(","))), seed=seed)
        atoms.rattle(0.05, seed=seed)
        atoms.calc = student
        opt = FIRE(atoms, logfile=None)
        opt.attach(lambda: frames.append((atoms.copy(), atoms.get_forces())), interval=args.every)  # forces cached
        opt.run(fmax=1e-3, steps=args.steps)
        print(f"seed {seed}: {opt.nsteps} FIRE steps, {len(frames)} frames so far", flush=True)
    calc = teacher()
    labelled = [label(frame, calc, "cantor") for frame, _ in frames]
    write(args.out, labelled, format="extxyz")
    errors = [np.abs(f.get_forces() - forces).mean() for f, (_, forces) in zip(labelled, frames)]
    print(f"{args.out}: {len(labelled)} frames; model vs teacher force MAE {1000 * np.mean(errors):.0f} meV/Å")


if __name__ == "__main__":
    main()
