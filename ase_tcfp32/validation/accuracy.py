"""Accuracy of a calculator against reference-labelled structures, per family."""

from __future__ import annotations

import numpy as np


def against_labels(calc, frames, family_key: str = "family") -> dict:
    """Energy MAE (meV/atom) and force MAE (meV/Å) of ``calc`` on labelled ``frames``.

    ``frames`` carry their reference energy and forces (e.g. read from an extxyz file)
    and a family name in ``atoms.info[family_key]``; returns ``{family: metrics}``.
    """
    table = {}
    for family in sorted({f.info[family_key] for f in frames}):
        de, df = [], []
        for ref in (f for f in frames if f.info[family_key] == family):
            atoms = ref.copy()
            atoms.calc = calc
            de.append(abs(atoms.get_potential_energy() - ref.get_potential_energy()) / len(atoms))
            df.append(np.abs(atoms.get_forces() - ref.get_forces()).ravel())
        table[family] = {
            "structures": len(de),
            "energy_mae_meV_atom": 1000 * float(np.mean(de)),
            "force_mae_meV_A": 1000 * float(np.mean(np.concatenate(df))),
        }
    return table


def direct_against_conservative(calc, frames, family_key: str = "family") -> dict:
    """How far a model's direct heads are from its own conservative forces and stress, per family.

    For each family of ``frames`` (``atoms.info[family_key]``), from one evaluation of both
    kinds per structure (:meth:`~ase_tcfp32.TCPETCalculator.evaluate`): the RMS of the direct
    forces minus the conservative ones and the conservative forces' own RMS (what predicting
    zero would score), meV/Å over all force components; and over the 3D-periodic structures
    the same for the stress (meV/Å³ over the six Voigt components), or None where there are none.
    ``calc`` computes conservative forces (``non_conservative=False``) of a model with direct heads.
    """
    table = {}
    for family in sorted({f.info[family_key] for f in frames}):
        members = [f for f in frames if f.info[family_key] == family]
        sums = {"force": [0.0, 0.0, 0], "stress": [0.0, 0.0, 0]}
        for atoms in members:
            bulk = bool(atoms.pbc.all())
            names = ["energy", "forces", "non_conservative_forces"]
            names += ["stress", "non_conservative_stress"] if bulk else []
            result = calc.evaluate([atoms], names)[0]
            pairs = [("force", "forces", "non_conservative_forces")]
            pairs += [("stress", "stress", "non_conservative_stress")] if bulk else []
            for key, conservative, direct in pairs:
                difference = result[direct] - result[conservative]
                sums[key][0] += float(np.sum(difference**2))
                sums[key][1] += float(np.sum(result[conservative] ** 2))
                sums[key][2] += result[conservative].size
        row = {"structures": len(members)}
        for key, (squares, reference, count) in sums.items():
            row[f"{key}_rms_difference"] = 1000 * np.sqrt(squares / count) if count else None
            row[f"{key}_rms_conservative"] = 1000 * np.sqrt(reference / count) if count else None
        table[family] = row
    return table
