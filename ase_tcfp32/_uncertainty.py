"""The LLPR beyond the energy: each atom's energy uncertainty on the device, and the
ensembles of forces and stress from the gradients of the energy ensemble.

metatrain's LLPR (:class:`ase_tcfp32._heads.LLPR`) reads the energy head's last-layer
features f_i [F] of each atom i. Per atom, ``sigma_i = multiplier * |L^-1 f_i|`` (L the
Cholesky factor of the calibrated covariance): ``f_i @ whiten`` with ``whiten = multiplier
* L^-T`` [F, F], one small float64 product per step (:meth:`Uncertainty.atoms`). Member k of a
structure's energy ensemble is ``E_k = w_k . F - mean_j(w_j . F) + E`` with F = sum_i f_i,
w_k the ensemble's last layers [K, F] and E the prediction (metatrain re-centres the
members on it, which also carries the terms that do not depend on positions). Its forces
and strain derivative are the prediction's plus those of ``(w_k - w̄) . F``, linear in the
Jacobian of F: with ``W - w̄ = C B`` (SVD: B [r, F] orthonormal rows, C [K, r], r <= min(K - 1,
F)), the r vector-Jacobian products of ``B F`` (one backward pass each, through the graph of
the step's own forward pass, in the model's precision) give every member's forces and
stress: ``forces_k = forces - C_k . d(B F)/dx``, ``virial_k = virial + C_k . d(B F)/d(strain)``.
No model evaluation per member; the demo model has r = 127, PET-MAD-S 127 for F = 512.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from ._heads import LLPR

LLPR_OUTPUTS = ("energy_features", "energy_uncertainty", "energy_ensemble")
"""What an engine (:class:`ase_tcfp32._engines.Engine`) of a model with an LLPR may also be
asked for: ``energy_features`` [n, F] (any model), each atom's ``energy_uncertainty`` [n] (eV), and
with ``"energy_ensemble"`` the ensemble members' conservative ``energy_ensemble_forces``
[n, 3, K] (eV/Å) and, with ``"stress"`` and for 3D-periodic structures,
``energy_ensemble_stress`` [3, 3, K] (eV/Å³): the gradients of metatrain's energy ensemble."""

RANK_TOLERANCE = 1e-12
"""Directions of the centred ensemble weights whose singular value is below this fraction
of the largest are left out (exact zeros: the centring removes one direction)."""


class Uncertainty:
    """The LLPR's matrices on an engine's device: ``whiten`` [F, F] float64 (per-atom sigma),
    and, when the LLPR has an ensemble, ``basis`` [r, F] (the model's dtype) and
    ``coefficients`` [K, r] float64 with ``W - w̄ = coefficients @ basis`` (else None)."""

    def __init__(self, llpr: LLPR, device: torch.device, dtype: torch.dtype):
        inverse = torch.linalg.solve_triangular(
            llpr.cholesky, torch.eye(len(llpr.cholesky), dtype=torch.float64), upper=False
        )
        self.whiten = (llpr.multiplier * inverse.T).to(device)
        self.basis = self.coefficients = None
        if llpr.weights is not None:
            left, values, right = torch.linalg.svd(llpr.weights - llpr.weights.mean(0), full_matrices=False)
            keep = values > RANK_TOLERANCE * values[0]
            self.basis = right[keep].to(device, dtype)
            self.coefficients = (left[:, keep] * values[keep]).to(device)

    @property
    def members(self) -> int:
        """K, the ensemble's members (0 without an ensemble)."""
        return 0 if self.coefficients is None else self.coefficients.shape[0]

    def atoms(self, features: torch.Tensor) -> torch.Tensor:
        """Each atom's energy uncertainty sigma [N] (eV, float64) from its last-layer
        ``features`` [N, F]."""
        return torch.linalg.vector_norm(features.double() @ self.whiten, dim=1)

    def jacobians(self, features: torch.Tensor, inputs: list[torch.Tensor], reduce=None) -> list[torch.Tensor]:
        """The derivatives [r, ...] of ``basis @ sum_i f_i`` by each of ``inputs`` (tensors
        the ``features`` [N, F] were computed from, through a graph kept for more backward
        passes): one backward pass per direction. ``reduce``, if given, maps the list of one
        direction's gradients to what is kept of them (e.g. pair gradients to virials)."""
        if self.basis is None:
            raise ValueError("this model's LLPR has no ensemble")
        projected = (features @ self.basis.T).sum(0)  # [r], in the model's precision
        kept = []
        for direction in range(projected.shape[0]):
            grads = torch.autograd.grad(projected[direction], inputs, retain_graph=True)
            kept.append(list(grads) if reduce is None else reduce(list(grads)))
        return [torch.stack(parts) for parts in zip(*kept)]

    def spread(self, jacobian: torch.Tensor) -> torch.Tensor:
        """``coefficients @ jacobian``: each member's departure [..., K] (float64) from the
        prediction's derivative, for a Jacobian [r, ...] from :meth:`jacobians`."""
        return torch.tensordot(jacobian.double(), self.coefficients, dims=([0], [1]))

    def outputs(self, names, features, out: dict, positions, vectors=None, virial=None) -> dict:
        """An engine step's LLPR outputs among ``names``, from the energy head's last-layer
        ``features`` [N, F] of atoms at ``positions`` [N, 3] (pair ``vectors`` [E, 3], whose
        gradients ``virial`` sums into strain derivatives per structure, None for no stress)
        and the step's own results ``out`` (``forces`` [N, 3], ``virial`` [S, 3, 3]):
        ``energy_uncertainty`` [N] (eV) and, with ``"energy_ensemble"``, each member's
        ``energy_ensemble_forces`` [N, 3, K] (eV/Å) and ``energy_ensemble_virial`` [S, 3, 3, K]
        (eV), all float64."""
        result = {}
        if "energy_uncertainty" in names:
            result["energy_uncertainty"] = self.atoms(features.detach())
        if "energy_ensemble" in names:
            if virial is None:
                (positions_jacobian,) = self.jacobians(features, [positions])
            else:
                positions_jacobian, strain_jacobian = self.jacobians(
                    features, [positions, vectors], lambda grads: [grads[0], virial(vectors, grads[1])]
                )
                result["energy_ensemble_virial"] = out["virial"].double()[..., None] + self.spread(strain_jacobian)
            result["energy_ensemble_forces"] = out["forces"].double()[..., None] - self.spread(positions_jacobian)
        return result


def voigt(ensemble: np.ndarray) -> np.ndarray:
    """A stress ensemble [3, 3, K] in Voigt order [6, K] (xx, yy, zz, yz, xz, xy), each
    off-diagonal the mean of the two it stands for (upet's conversion)."""
    s = ensemble
    return np.stack(
        [s[0, 0], s[1, 1], s[2, 2], (s[1, 2] + s[2, 1]) / 2, (s[0, 2] + s[2, 0]) / 2, (s[0, 1] + s[1, 0]) / 2]
    )


def check_threshold(threshold) -> float | None:
    """upet's and metatomic-ase's ``uncertainty_threshold``: a per-atom energy uncertainty
    (eV) above which every energy calculation warns, or None (no check); a clear error for
    anything else, whether the model has an uncertainty or not."""
    if threshold is None:
        return None
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, np.integer, np.floating)):
        raise ValueError(f"uncertainty_threshold is an energy in eV (or None), not {threshold!r}")
    if not threshold > 0 or not np.isfinite(threshold):
        raise ValueError(f"`uncertainty_threshold` is {threshold} but must be positive (and finite), or None")
    return float(threshold)


def warn_above(threshold: float, sigmas: list[np.ndarray]) -> None:
    """metatomic-ase's warning, naming the atoms whose energy uncertainty in ``sigmas`` (one
    array [n] per structure, eV) exceeds ``threshold`` (and the structures, for several)."""
    above = [(k, np.where(sigma > threshold)[0]) for k, sigma in enumerate(sigmas)]
    above = [(k, atoms) for k, atoms in above if len(atoms)]
    if not above:
        return
    where = f"atoms {above[0][1]}" if len(sigmas) == 1 else "; ".join(f"structure {k}: atoms {a}" for k, a in above)
    warnings.warn(
        "Some of the atomic energy uncertainties are larger than the threshold of "
        f"{threshold} eV. The prediction is above the threshold for {where}.",
        stacklevel=4,
    )


NO_ENSEMBLE = (
    "the energy ensemble is required for the {quantity} ensemble (gradients of its members), but this model "
    "carries none: PET-MAD releases and the bundled demo model do (see docs/upet.md)"
)

NO_DIRECT_ENSEMBLE = (
    "non-conservative {quantity} uncertainty/ensemble is not available for this model: it has no ensemble of its "
    "direct {quantity} head{read}. Use the conservative regime (non_conservative=False, for the calculator and the "
    "call) to get the {quantity} ensemble from the gradients of the energy ensemble"
)


def unavailable(quantity: str, direct: bool, llpr: LLPR | None, direct_ensembles: set[str]) -> str | None:
    """Why the ``quantity`` (``"force"`` or ``"stress"``) ensemble cannot be computed, in
    upet's terms, or None: the ``direct`` (non-conservative) regime needs an ensemble of
    that direct head, which ase-tcfp32 does not read (``direct_ensembles``: those the
    checkpoint has); the conservative one the LLPR's energy ensemble."""
    if direct:
        read = " that ase-tcfp32 reads (the checkpoint has one: upet reads it)" if direct_ensembles else ""
        return NO_DIRECT_ENSEMBLE.format(quantity=quantity, read=read)
    if llpr is None or llpr.weights is None:
        return NO_ENSEMBLE.format(quantity=quantity)
    return None
