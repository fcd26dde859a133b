"""Add the demo model's own conservative forces and stress to a teacher-labelled data set,
as the targets of its direct (non-conservative) force and stress heads.

    python scripts/demo_model/direct_targets.py MODEL.ckpt OUT_PREFIX IN.xyz [IN.xyz ...]

Writes ``OUT_PREFIX-bulk.xyz`` (3D-periodic structures) and ``OUT_PREFIX-open.xyz`` (slabs
and molecules: no stress), keeping the teacher's labels (``energy``, ``forces``, and its
stress as ``ref_stress``, a 9-vector, on the 3D-periodic ones) and adding ``demo_forces``
(per atom) and ``demo_stress`` (9-vector, 3D-periodic only): the conservative forces and
stress of MODEL (FP32, CPU), i.e. the gradients of the energy the heads must not change.
The direct heads of the (unshipped) experiment ``scripts/demo_model/heads.yaml`` were
fitted to these; see docs/demo_model.md, "Direct force and stress heads".
"""

import sys
import warnings

import torch
from ase.io import read, write
from ase.stress import voigt_6_to_full_3x3_stress


def demo_calculator(checkpoint: str):
    from metatomic_ase import MetatomicCalculator
    from metatrain.utils.io import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(checkpoint)
        return MetatomicCalculator(model.export(), device="cpu", uncertainty_threshold=None)


def main(checkpoint: str, prefix: str, *sources: str) -> None:
    torch.set_num_threads(1)
    calc = demo_calculator(checkpoint)
    bulk, open_ = [], []
    for source in sources:
        for atoms in read(source, ":"):
            teacher = atoms.calc.results
            labelled = atoms.copy()
            labelled.info["energy"] = teacher["energy"]
            labelled.arrays["forces"] = teacher["forces"]
            atoms.calc = calc
            labelled.arrays["demo_forces"] = atoms.get_forces()
            if atoms.pbc.all():
                labelled.info["demo_stress"] = voigt_6_to_full_3x3_stress(atoms.get_stress()).reshape(9)
                labelled.info["ref_stress"] = voigt_6_to_full_3x3_stress(teacher["stress"]).reshape(9)
                bulk.append(labelled)
            else:
                open_.append(labelled)
    for name, frames in (("bulk", bulk), ("open", open_)):
        for atoms in frames:  # plain info/arrays keys only: metatrain reads them by name
            atoms.calc = None
        write(f"{prefix}-{name}.xyz", frames, format="extxyz")
        print(f"{prefix}-{name}.xyz: {len(frames)} structures, {sum(len(a) for a in frames)} atoms")


if __name__ == "__main__":
    main(*sys.argv[1:])
