"""upet's uncertainty and ensemble methods of :class:`~ase_tcfp32.TCPETCalculator`.

``get_energy_uncertainty`` / ``get_energy_ensemble`` (per structure or per atom),
``get_forces_ensemble`` / ``get_forces_uncertainty`` and ``get_stress_ensemble`` /
``get_stress_uncertainty`` in upet's two regimes (the gradients of the energy ensemble, or
the direct heads' own ensembles), and ``supports_uncertainty``, with upet's arguments,
defaults (the last calculated structure) and errors. The numbers come from the calculator's
own evaluations (:mod:`ase_tcfp32._uncertainty` computes them in the engine); this mixin
asks for them and shapes them as upet returns them. It uses the calculator's ``_llpr``,
``heads``, ``non_conservative`` and ``_compute``.
"""

from __future__ import annotations

import numpy as np
import torch
from ase import Atoms

from . import _uncertainty


class LLPRMethods:
    """upet's uncertainty methods, for :class:`~ase_tcfp32.TCPETCalculator` (see the module doc)."""

    @property
    def supports_uncertainty(self) -> bool:
        """upet's: whether the model carries an LLPR energy uncertainty (as PET-MAD releases
        do) and ``uncertainty_threshold`` checks it (upet says False with ``None``; the
        ``get_*_uncertainty`` and ``get_*_ensemble`` methods work either way)."""
        return self._llpr is not None and self.uncertainty_threshold is not None

    def get_energy_uncertainty(self, atoms: Atoms | None = None, per_atom: bool = False) -> np.ndarray:
        """upet's: the LLPR uncertainty (eV) of the energy of ``atoms`` (default: the last
        calculated structure): a 0-d array, or with ``per_atom`` one per atom [n]. The same
        calibrated rigidity as metatrain's ``energy_uncertainty`` output, from the energy
        head's last-layer features of the calculator's own evaluation (its precision)."""
        features, energies = self._llpr_inputs(atoms)
        rows = features if per_atom else features.sum(0, keepdim=True)
        sigma = self._llpr.uncertainty(rows).numpy()
        return sigma if per_atom else sigma.reshape(())

    def get_energy_ensemble(self, atoms: Atoms | None = None, per_atom: bool = False) -> np.ndarray:
        """upet's: the LLPR ensemble of the energy (eV) of ``atoms`` [K], or of each atom's
        energy [n, K] with ``per_atom``; its mean is the prediction."""
        features, energies = self._llpr_inputs(atoms)
        if per_atom:
            return self._llpr.ensemble(features, energies).numpy()
        return self._llpr.ensemble(features.sum(0, keepdim=True), energies.sum(0, keepdim=True)).numpy()[0]

    def get_forces_ensemble(self, atoms: Atoms | None = None, non_conservative: bool | None = None) -> np.ndarray:
        """upet's: the forces [n, 3, K] (eV/Å) of each LLPR ensemble member on ``atoms``
        (default: the last calculated structure), net force removed per member. In the
        conservative regime, -dE_k/dx of metatrain's energy ensemble: one forward pass and
        a backward pass per independent direction of the ensemble's weights
        (:mod:`ase_tcfp32._uncertainty`), in the calculator's precision. The
        non-conservative regime (``non_conservative=True``, or by default on a calculator
        reading the direct forces) reads metatrain's ensemble of the direct force head from
        the same forward pass (its product in the calculator's precision); on a conservative
        calculator it is re-centred on the conservative forces, keeping its spread, as upet
        does. ``NotImplementedError`` where the model lacks the ensemble, and for
        ``non_conservative=False`` on a calculator reading the direct forces."""
        direct = self._ensemble_regime("forces", non_conservative)
        atoms = self._resolve(atoms)
        self.check_atoms(atoms, ["forces"])
        name = "non_conservative_forces_ensemble" if direct else "forces_ensemble"
        recentre = direct and not self._direct_forces
        result = self._compute([atoms], ("energy", name, *(("forces",) if recentre else ())))[0]
        members = result[name]
        if recentre:  # upet: about the calculator's forces (rotationally averaged where it averages)
            forces = self.get_forces(atoms) if self.rotational_average_order else result["forces"]
            members = members + (forces - members.mean(-1))[..., None]
        return members

    def get_forces_uncertainty(self, atoms: Atoms | None = None, non_conservative: bool | None = None) -> np.ndarray:
        """upet's: the standard deviation [n, 3] (eV/Å) of :meth:`get_forces_ensemble`."""
        return self.get_forces_ensemble(atoms, non_conservative).std(axis=-1)

    def get_stress_ensemble(
        self, atoms: Atoms | None = None, voigt: bool = True, non_conservative: bool | None = None
    ) -> np.ndarray:
        """upet's: the stress of each LLPR ensemble member on ``atoms`` (3D-periodic; default:
        the last calculated), eV/Å³ in ASE's sign: [6, K] in Voigt order, or [3, 3, K] with
        ``voigt=False``. Regimes as :meth:`get_forces_ensemble`: the conservative one the
        strain derivatives of the energy ensemble over the volume; the non-conservative one
        metatrain's ensemble of the direct stress head, as upet reads it (centred on the
        direct stress whatever the calculator reads; its spread, metatrain's, is neither
        divided by the volume nor symmetrized)."""
        direct = self._ensemble_regime("stress", non_conservative)
        atoms = self._resolve(atoms)
        self.check_atoms(atoms, ["stress"])
        name = "non_conservative_stress_ensemble" if direct else "stress_ensemble"
        members = self._compute([atoms], ("energy", name))[0][name]
        return _uncertainty.voigt(members) if voigt else members

    def get_stress_uncertainty(
        self, atoms: Atoms | None = None, voigt: bool = True, non_conservative: bool | None = None
    ) -> np.ndarray:
        """upet's: the standard deviation of :meth:`get_stress_ensemble` (eV/Å³): [6], or
        [3, 3] with ``voigt=False``."""
        return self.get_stress_ensemble(atoms, voigt, non_conservative).std(axis=-1)

    def _ensemble_regime(self, quantity: str, non_conservative: bool | None) -> bool:
        """upet's rule for the ``quantity`` (``"forces"`` or ``"stress"``) ensemble: whether it
        is the direct head's (where the calculator reads that head or the call asks for it),
        else the gradients of the energy ensemble; ``NotImplementedError`` where the model
        lacks it, and for the conservative one on a calculator reading the direct head."""
        if non_conservative not in (None, True, False):
            raise ValueError(f"non_conservative is None, True or False, not {non_conservative!r}")
        read = self._direct_forces if quantity == "forces" else self._direct_stress
        name = "force" if quantity == "forces" else "stress"
        if read and non_conservative is False:
            raise NotImplementedError(
                f"the conservative {name} ensemble (non_conservative=False) needs a calculator computing conservative "
                f"{quantity}; this one reads the direct {name} head (non_conservative={self.non_conservative!r})"
            )
        direct = read or bool(non_conservative)
        problem = _uncertainty.unavailable(name, direct, self._llpr, self.heads)
        if problem is not None:
            raise NotImplementedError(problem)
        return direct

    def _resolve(self, atoms: Atoms | None) -> Atoms:
        """``atoms``, or the last calculated structure (upet's default)."""
        atoms = atoms if atoms is not None else self.atoms
        if atoms is None:
            raise ValueError("no atoms given and none calculated yet")
        return atoms

    def _llpr_inputs(self, atoms: Atoms | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The energy head's last-layer features [n, F] and the per-atom energies [n] of
        ``atoms`` (default: the last calculated), float64."""
        if self._llpr is None:
            raise NotImplementedError(
                "this model carries no LLPR uncertainty: PET-MAD releases and the bundled demo model do "
                "(see docs/upet.md)"
            )
        atoms = self._resolve(atoms)
        self.check_atoms(atoms, ["energy"])
        result = self._compute([atoms], ("energy", "energies", "energy_features"))[0]
        return torch.from_numpy(result["energy_features"]), torch.from_numpy(np.asarray(result["energies"]))
