"""mtt options that train the direct heads beside the energy: the teacher's forces and stress twice.

    python scripts/demo_model/direct_options.py DATA FOLDER

``DATA/{train,val}.xyz`` (``make_dataset.py``'s labels, or a stage's data, ``family`` in each
structure's info) become ``FOLDER/{train,val}-{bulk,open}.xyz``, the 3D-periodic structures
and the others, and ``FOLDER/options.yaml``: the recipe's ``options.yaml`` with the teacher's
forces also as the ``non_conservative_force`` target and its stress as
``non_conservative_stress`` (bulk structures only: the others have no stress). The direct
pre-training and every stage of the recipe from stage 1 on train with such options
(``scripts/train_demo_model.sh``).
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


def write_sets(data: Path, folder: Path) -> dict:
    """``folder/{split}-{bulk,open}.xyz`` from ``data/{split}.xyz``, and their mtt sections by split."""
    from ase.io import read, write

    folder.mkdir(parents=True, exist_ok=True)
    sections = {}
    for split in ("train", "val"):
        frames = read(data / f"{split}.xyz", ":")
        for frame in frames:  # metatrain reads a set's arrays as one table: the labels only
            for key in [k for k in frame.arrays if k not in ("numbers", "positions")]:
                del frame.arrays[key]
        write(folder / f"{split}-bulk.xyz", [f for f in frames if f.pbc.all()])
        write(folder / f"{split}-open.xyz", [f for f in frames if not f.pbc.all()])
        sections[split] = [
            {
                "systems": {"read_from": f"{split}-bulk.xyz", "length_unit": "angstrom"},
                "targets": {
                    "energy": ENERGY,
                    "non_conservative_force": TEACHER_FORCE,
                    "non_conservative_stress": TEACHER_STRESS,
                },
            },
            {
                "systems": {"read_from": f"{split}-open.xyz", "length_unit": "angstrom"},
                "targets": {"energy": ENERGY, "non_conservative_force": TEACHER_FORCE},
            },
        ]
    return sections


def write_options(data: Path, folder: Path) -> Path:
    """``folder/options.yaml`` (returned) and the sets it reads (:func:`write_sets`)."""
    sections = write_sets(data, folder)
    options = yaml.safe_load((HERE / "options.yaml").read_text())
    options["architecture"]["training"]["per_structure_targets"] = ["non_conservative_stress"]
    options.update(training_set=sections["train"], validation_set=sections["val"], test_set=0.0)
    (folder / "options.yaml").write_text(yaml.safe_dump(options, sort_keys=False))
    return folder / "options.yaml"


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    data, folder = map(Path, sys.argv[1:])
    if not (data / "train.xyz").exists():
        sys.exit(f"{data}/train.xyz missing: run scripts/make_dataset.py --out {data} first")
    print(write_options(data, folder))
