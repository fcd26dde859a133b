"""mtt options that train the direct heads beside the energy: the teacher's forces and stress twice.

    python scripts/demo_model/direct_options.py DATA FOLDER [--own MODEL.ckpt]

``DATA/{train,val}.xyz`` (``make_dataset.py``'s labels, or a stage's data, ``family`` in each
structure's info) become ``FOLDER/{train,val}-{bulk,open}.xyz``, the 3D-periodic structures
and the others, and ``FOLDER/options.yaml``: the recipe's ``options.yaml`` with the teacher's
forces also as the ``non_conservative_force`` target and its stress as
``non_conservative_stress`` (bulk structures only: the others have no stress). The direct
pre-training and stages 1-4 of the recipe train with such options
(``scripts/train_demo_model.sh``).

With ``--own``, the direct targets are instead MODEL's own conservative forces and stress
(FP32, CPU; stored as ``own_forces`` per atom and ``own_stress``, a 9-vector): what multiple
time stepping needs the direct heads to match, since its inner steps stand in for them.
The energy and its forces still fit the teacher. Stage 5 trains this way.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ENERGY = {"key": "energy", "unit": "eV", "forces": {"key": "forces"}, "stress": False, "virial": False}
TEACHER_FORCE = {
    "key": "forces",
    "quantity": "force",
    "unit": "eV/A",
    "sample_kind": "atom",
    "type": {"cartesian": {"rank": 1}},
}
"""The direct-force target: the teacher's forces [atoms, 3]."""
TEACHER_STRESS = {
    "key": "stress",
    "quantity": "pressure",
    "unit": "eV/A^3",
    "sample_kind": "system",
    "type": {"cartesian": {"rank": 2}},
}
"""The direct-stress target: the teacher's stress (a 3 x 3 matrix on 3D-periodic structures)."""
OWN_FORCE = dict(TEACHER_FORCE, key="own_forces")
"""The direct-force target with ``--own``: the model's own conservative forces [atoms, 3]."""
OWN_STRESS = dict(TEACHER_STRESS, key="own_stress")
"""The direct-stress target with ``--own``: the model's own stress (9-vector, 3D-periodic only)."""


def own_labeller(checkpoint: Path):
    """``label(frame)``: ``frame`` with ``own_forces`` [atoms, 3] (eV/Å) and, 3D-periodic,
    ``own_stress`` [9] (eV/Å³) from ``checkpoint``'s conservative outputs (FP32, CPU, through
    metatomic-ase: :func:`direct_targets.demo_calculator`), copies of one structure labelled
    once (the recipe repeats families)."""
    import numpy as np
    from direct_targets import demo_calculator  # this folder is on the path of a script run from it

    calc = demo_calculator(str(checkpoint))
    done = {}

    def label(frame):
        key = (frame.numbers.tobytes(), frame.positions.tobytes(), frame.cell.array.tobytes())
        if key not in done:
            atoms = frame.copy()
            atoms.calc = calc
            stress = atoms.get_stress(voigt=False).reshape(9) if atoms.pbc.all() else None
            done[key] = (atoms.get_forces().copy(), stress)
        forces, stress = done[key]
        frame.arrays["own_forces"] = np.array(forces)
        if stress is not None:
            frame.info["own_stress"] = np.array(stress)
        return frame

    return label


def write_sets(data: Path, folder: Path, own: Path | None = None) -> dict:
    """``folder/{split}-{bulk,open}.xyz`` from ``data/{split}.xyz``, and their mtt sections by
    split; with ``own``, that checkpoint's conservative forces and stress as the direct targets."""
    from ase.io import read, write

    folder.mkdir(parents=True, exist_ok=True)
    force, stress = (OWN_FORCE, OWN_STRESS) if own else (TEACHER_FORCE, TEACHER_STRESS)
    label = own_labeller(own) if own else None
    sections = {}
    for split in ("train", "val"):
        frames = read(data / f"{split}.xyz", ":")
        for frame in frames:  # metatrain reads a set's arrays as one table: the labels only
            for key in [k for k in frame.arrays if k not in ("numbers", "positions")]:
                del frame.arrays[key]
            if label:
                label(frame)
        write(folder / f"{split}-bulk.xyz", [f for f in frames if f.pbc.all()])
        write(folder / f"{split}-open.xyz", [f for f in frames if not f.pbc.all()])
        sections[split] = [
            {
                "systems": {"read_from": f"{split}-bulk.xyz", "length_unit": "angstrom"},
                "targets": {
                    "energy": ENERGY,
                    "non_conservative_force": force,
                    "non_conservative_stress": stress,
                },
            },
            {
                "systems": {"read_from": f"{split}-open.xyz", "length_unit": "angstrom"},
                "targets": {"energy": ENERGY, "non_conservative_force": force},
            },
        ]
    return sections


def write_options(data: Path, folder: Path, own: Path | None = None) -> Path:
    """``folder/options.yaml`` (returned) and the sets it reads (:func:`write_sets`)."""
    sections = write_sets(data, folder, own)
    options = yaml.safe_load((HERE / "options.yaml").read_text())
    options["architecture"]["training"]["per_structure_targets"] = ["non_conservative_stress"]
    options.update(training_set=sections["train"], validation_set=sections["val"], test_set=0.0)
    (folder / "options.yaml").write_text(yaml.safe_dump(options, sort_keys=False))
    return folder / "options.yaml"


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", type=Path, help="folder with train.xyz and val.xyz")
    parser.add_argument("folder", type=Path, help="where the sets and options.yaml go")
    parser.add_argument("--own", type=Path, default=None, help="fit the direct heads to this checkpoint's own outputs")
    args = parser.parse_args()
    if not (args.data / "train.xyz").exists():
        sys.exit(f"{args.data}/train.xyz missing: run scripts/make_dataset.py --out {args.data} first")
    if args.own and not args.own.exists():
        sys.exit(f"{args.own} missing: the checkpoint whose own forces the direct heads should fit")
    print(write_options(args.data, args.folder, args.own))
