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

The direct heads' ensembles (a checkpoint whose LLPR has them: ``LLPR.direct``) are
metatrain's ``mtt::aux::<target>_ensemble`` outputs: from the head's own last-layer features
g [F] (per atom for the forces; summed over the structure's atoms for the stress), member
k's component c is ``W[k C + c] . g`` (C = 3 or 9 components), re-centred on the head's
prediction p: ``p_c + W[k C + c] . g - mean_j(W[j C + c] . g)``. The product runs in a layer
that computes as the head's own last layer does (the calculator's precision, on its
device), with the weights centred over the members beforehand in float64 (the same
numbers, without the cancellation of the members' common part). upet then removes each
force member's net force; the stress members are [3, 3, K] as metatrain gives them: their
spread is not divided by the volume, nor symmetrized (only the prediction is).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import numpy as np
import torch

from ._heads import COMPONENTS, ENERGY, FORCE, LLPR, STRESS, Heads, per_structure_centred, per_structure_sums
from .layers import TCLinear

DIRECT_ENSEMBLES = {"non_conservative_forces_ensemble": FORCE, "non_conservative_stress_ensemble": STRESS}
"""The direct heads' ensembles an engine may be asked for, and the head of each."""

LLPR_OUTPUTS = ("energy_features", "energy_uncertainty", "energy_ensemble", *DIRECT_ENSEMBLES)
"""What an engine (:class:`ase_tcfp32._engines.Engine`) of a model with an LLPR may also be
asked for: ``energy_features`` [n, F] (any model), each atom's ``energy_uncertainty`` [n] (eV),
with ``"energy_ensemble"`` the ensemble members' conservative ``energy_ensemble_forces``
[n, 3, K] (eV/Å) and, with ``"stress"`` and for 3D-periodic structures,
``energy_ensemble_stress`` [3, 3, K] (eV/Å³): the gradients of metatrain's energy ensemble;
and, where the LLPR has them, the direct heads' ensembles (the direct results come with
them): ``non_conservative_forces_ensemble`` [n, 3, K] (eV/Å, net force removed per member)
and, for 3D-periodic structures, ``non_conservative_stress_ensemble`` [3, 3, K] (eV/Å³)."""


def direct_ensembles(llpr: LLPR | None, heads: Heads | None) -> dict[str, str]:
    """The direct heads (``FORCE``, ``STRESS``) among ``heads`` whose ensemble ``llpr``
    has, and the target name of each."""
    if llpr is None or heads is None:
        return {}
    return {q: heads.names[q] for q in (FORCE, STRESS) if q in heads.names and heads.names[q] in llpr.direct}


def features_for(names: Iterable[str]) -> tuple[str, ...]:
    """The heads (``ENERGY``, ``FORCE``, ``STRESS``) whose last-layer features the LLPR
    outputs ``names`` are computed from."""
    wanted = {DIRECT_ENSEMBLES.get(name, ENERGY) for name in names}
    return tuple(quantity for quantity in (ENERGY, FORCE, STRESS) if quantity in wanted)


def ensemble_layer(backend: torch.nn.Module, name: str, weight: torch.Tensor, device) -> torch.nn.Module:
    """A bias-free Linear layer of ``weight`` [out, F] on ``device`` that computes as target
    ``name``'s own last layer does: its dtype and, where it is a
    :class:`ase_tcfp32.layers.TCLinear`, its precision (emulated or on tensor cores)."""
    last = next(iter(backend.node_last_layers[name][0].values()))
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=device, dtype=last.weight.dtype)
    layer.weight.requires_grad_(False).copy_(weight)
    if isinstance(last, TCLinear):
        return TCLinear.from_linear(layer, last.precision, last.emulate, last.check_accuracy, f"{name} ensemble")
    return layer


RANK_TOLERANCE = 1e-12
"""Directions of the centred ensemble weights whose singular value is below this fraction
of the largest are left out (exact zeros: the centring removes one direction)."""


class Uncertainty:
    """The LLPR's matrices on an engine's device: ``whiten`` [F, F] float64 (per-atom sigma),
    and, when the LLPR has an energy ensemble, ``basis`` [r, F] (the model's dtype) and
    ``coefficients`` [K, r] float64 with ``W - w̄ = coefficients @ basis`` (else None);
    ``direct``: the ensemble layer of each direct head among ``heads`` that the LLPR has an
    ensemble of (:func:`ensemble_layer` on ``backend``, weights centred over the members).
    ``llpr`` None: a model without one (only ``energy_features`` can be computed)."""

    def __init__(
        self, llpr: LLPR | None, device: torch.device, dtype: torch.dtype, backend=None, heads: Heads | None = None
    ):
        self.llpr = llpr
        self.whiten = self.basis = self.coefficients = None
        self.direct, self.targets = {}, direct_ensembles(llpr, heads)  # by head: ensemble layer, target name
        if llpr is None:
            return
        inverse = torch.linalg.solve_triangular(
            llpr.cholesky, torch.eye(len(llpr.cholesky), dtype=torch.float64), upper=False
        )
        self.whiten = (llpr.multiplier * inverse.T).to(device)
        if llpr.weights is not None:
            left, values, right = torch.linalg.svd(llpr.weights - llpr.weights.mean(0), full_matrices=False)
            keep = values > RANK_TOLERANCE * values[0]
            self.basis = right[keep].to(device, dtype)
            self.coefficients = (left[:, keep] * values[keep]).to(device)
        for quantity, name in self.targets.items():
            weight = llpr.direct[name]
            members = weight.reshape(-1, COMPONENTS[quantity], weight.shape[1])
            centred = (members - members.mean(0)).reshape(weight.shape)
            self.direct[quantity] = ensemble_layer(backend, name, centred, device)

    def check(self, names: Iterable[str]) -> tuple[str, ...]:
        """The LLPR outputs ``names`` as a tuple, or a clear error for one the model lacks."""
        names = tuple(names)
        if set(names) - {"energy_features"} and self.llpr is None:
            raise ValueError("this model carries no LLPR uncertainty")
        missing = [name for name in names if DIRECT_ENSEMBLES.get(name, ENERGY) not in (ENERGY, *self.direct)]
        if missing:
            raise ValueError(f"this model's LLPR has no ensemble of the direct head for {', '.join(missing)}")
        return names

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

    def direct_members(self, quantity: str, features: torch.Tensor, prediction: torch.Tensor) -> torch.Tensor:
        """metatrain's ensemble [M, *components, K] (float64) of direct head ``quantity`` for
        rows of its last-layer ``features`` [M, F] (the model's dtype) whose predictions are
        ``prediction`` [M, *components]: the prediction plus each member's departure from
        the members' mean, from one product in the ensemble layer's precision."""
        rows, components = prediction.shape[0], COMPONENTS[quantity]
        spread = self.direct[quantity](features.contiguous()).double()  # [M, K * C], member-major
        spread = spread.reshape(rows, -1, components).transpose(1, 2)
        spread = spread - spread.mean(-1, keepdim=True)
        return (prediction.double().reshape(rows, components, 1) + spread).reshape(*prediction.shape, -1)

    def outputs(self, names, found: dict, out: dict, positions, system, vectors=None, virial=None) -> dict:
        """An engine step's LLPR outputs among ``names`` (:data:`LLPR_OUTPUTS`), from the
        last-layer features ``found`` of each head (:func:`features_for`: ``ENERGY`` [N, F]...)
        of atoms at ``positions`` [N, 3] in structures ``system`` [N] (pair ``vectors`` [E, 3],
        whose gradients ``virial`` sums into strain derivatives per structure, None for no
        stress) and the step's own results ``out`` (``energy`` [S], ``forces`` [N, 3],
        ``virial`` [S, 3, 3], the direct heads' results): ``energy_features`` [N, F],
        ``energy_uncertainty`` [N] (eV), with ``"energy_ensemble"`` each member's
        ``energy_ensemble_forces`` [N, 3, K] (eV/Å) and ``energy_ensemble_virial`` [S, 3, 3, K]
        (eV), and the direct heads' ensembles, all but the features float64."""
        result = {}
        features = found.get(ENERGY)
        if "energy_features" in names:
            result["energy_features"] = features.detach()
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
        count = out["energy"].shape[0]
        if "non_conservative_forces_ensemble" in names:
            members = self.direct_members(FORCE, found[FORCE].detach(), out["non_conservative_forces"])
            result["non_conservative_forces_ensemble"] = per_structure_centred(members, system, count)
        if "non_conservative_stress_ensemble" in names:
            summed = per_structure_sums(found[STRESS].detach(), system, count)  # metatrain's per-system features
            result["non_conservative_stress_ensemble"] = self.direct_members(
                STRESS, summed, out["non_conservative_stress"]
            )
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


NAMED_STRUCTURES = 4
"""How many structures above the threshold one warning names (the others are counted)."""


def warn_above(threshold: float, sigmas: list[np.ndarray]) -> None:
    """metatomic-ase's warning, naming the atoms whose energy uncertainty in ``sigmas`` (one
    array [n] per structure, eV) exceeds ``threshold`` (and the structures, for several)."""
    above = [(k, np.where(sigma > threshold)[0]) for k, sigma in enumerate(sigmas)]
    above = [(k, atoms) for k, atoms in above if len(atoms)]
    if not above:
        return
    if len(sigmas) == 1:
        where = f"atoms {_listed(above[0][1])}"
    else:  # many structures (rotated copies, path-integral beads): the first few named, the rest counted
        where = "; ".join(f"structure {k}: atoms {_listed(atoms)}" for k, atoms in above[:NAMED_STRUCTURES])
        if len(above) > NAMED_STRUCTURES:
            more = len(above) - NAMED_STRUCTURES
            where = f"{len(above)} of {len(sigmas)} structures ({where}; and {more} more)"
    warnings.warn(
        "Some of the atomic energy uncertainties are larger than the threshold of "
        f"{threshold} eV. The prediction is above the threshold for {where}.",
        stacklevel=4,
    )


def _listed(indices: np.ndarray, shown: int = 32) -> str:
    """``[0 1 2]``: the indices on one line, the first ``shown`` of a longer list and how many
    more (a 17,280-atom system named every atom in 100 kB of text); written without numpy's
    array printing (174 indices on a 2-core CPU: 0.17 ms against 0.014 ms, at every energy
    calculation that warns, whether the warning is shown or not)."""
    more = f" ... and {len(indices) - shown} more" if len(indices) > shown else ""
    return "[" + " ".join(map(str, indices[:shown].tolist())) + more + "]"


NO_ENSEMBLE = (
    "the energy ensemble is required for the {quantity} ensemble (gradients of its members), but this model "
    "carries none: PET-MAD releases and the bundled demo model do (see docs/upet.md)"
)

NO_DIRECT_ENSEMBLE = (
    "non-conservative {quantity} uncertainty/ensemble is not available for this model: {why}. Use the conservative "
    "regime (non_conservative=False, for the calculator and the call) to get the {quantity} ensemble from the "
    "gradients of the energy ensemble"
)


def unavailable(quantity: str, direct: bool, llpr: LLPR | None, heads: Heads) -> str | None:
    """Why the ``quantity`` (``"force"`` or ``"stress"``) ensemble cannot be computed, in
    upet's terms, or None: the ``direct`` (non-conservative) regime needs the LLPR's
    ensemble of that direct head among ``heads``, the conservative one the energy ensemble."""
    if not direct:
        return NO_ENSEMBLE.format(quantity=quantity) if llpr is None or llpr.weights is None else None
    head = FORCE if quantity == "force" else STRESS
    if head not in heads.names:
        why = f"it has no direct {quantity} head"
    elif llpr is None:
        why = f"it carries no LLPR uncertainty, and so no ensemble of its direct {quantity} head"
    elif head not in direct_ensembles(llpr, heads):
        key = f"mtt::aux::{heads.names[head]}_ensemble"
        why = f"its LLPR has no ensemble of the direct {quantity} head (metatrain's {key!r} output)"
    else:
        return None
    return NO_DIRECT_ENSEMBLE.format(quantity=quantity, why=why)
