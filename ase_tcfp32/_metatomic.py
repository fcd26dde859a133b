"""The metatomic engine: metatomic-ase's ``MetatomicCalculator`` around the exported model.

Neighbor lists are vesin's, through metatomic-ase (with its own Verlet skin), forces and
the strain-derivative stress from autograd in TorchScript. Slower per step than the lean
engine, but it evaluates every PET the lean engine cannot (long-range modules,
charge/spin conditioning, other additive models or units).
"""

from __future__ import annotations

import numpy as np
import torch
from ase import Atoms
from ase.calculators.calculator import all_changes
from ase.stress import voigt_6_to_full_3x3_stress

from .models import import_dependencies


class MetatomicEngine:
    """Energies, forces and stress of metatrain ``pet`` through metatomic-ase.

    :param pet: a metatrain PET (its Linear layers in any precision).
    :param device: where to evaluate it.
    :param skin: Verlet skin (Å) of metatomic-ase's neighbor lists.
    """

    def __init__(self, pet: torch.nn.Module, device: torch.device, skin: float):
        import_dependencies(metatomic_ase=True)
        from metatomic_ase import MetatomicCalculator

        self.calculator = MetatomicCalculator(
            pet.export().eval(),
            device=str(device),
            do_gradients_with_energy=False,
            uncertainty_threshold=None,
            neighbor_skin=skin,
        )

    def compute(self, structures: list[Atoms], properties) -> list[dict]:
        """Per structure: ``energy`` (eV), ``energies`` [n] (eV; for one structure only when
        asked), ``forces`` [n, 3] (eV/Å) and, when ``"stress"`` is asked, ``stress`` [3, 3]
        (eV/Å³) of each 3D-periodic structure. One structure goes through metatomic-ase's
        ``calculate``, which keeps its neighbor list between calls; several through one
        batched model call."""
        if len(structures) == 1:
            return [self._single(structures[0], properties)]
        stress = "stress" in properties and any(atoms.pbc.all() for atoms in structures)
        return self._batch(structures, stress)

    def _single(self, atoms: Atoms, properties) -> dict:
        wanted = ["energy", "forces"] + (["energies"] if "energies" in properties else [])
        self.calculator.calculate(atoms, wanted, all_changes)
        result = {
            key: value for key, value in self.calculator.results.items() if key in ("energy", "energies", "forces")
        }
        if "stress" in properties and "stress" in self.calculator.results:  # given for 3D-periodic systems
            result["stress"] = voigt_6_to_full_3x3_stress(self.calculator.results["stress"])
        return result

    def _batch(self, structures: list[Atoms], stress: bool) -> list[dict]:
        periodic = all(atoms.pbc.all() for atoms in structures)
        out = self.calculator.compute_energy(structures, compute_forces_and_stresses=True, per_atom=True)
        results = []
        for k, atoms in enumerate(structures):
            result = {
                "energy": float(out["energy"][k]),
                "energies": np.asarray(out["energies"][k], float),
                "forces": np.asarray(out["forces"][k], float),
            }
            if stress and periodic:
                result["stress"] = np.asarray(out["stress"][k], float).reshape(3, 3)
            results.append(result)
        if stress and not periodic:  # metatomic-ase gives stress only for all-periodic batches
            for k, atoms in enumerate(structures):
                if atoms.pbc.all():
                    results[k]["stress"] = self._batch([atoms], True)[0]["stress"]
        return results
