"""Rotational averaging: PET's predictions averaged over a quadrature of O(3).

PET is not exactly rotation invariant. Like upet's ``UPETCalculator(rotational_average_order=L)``
(metatomic-ase's ``SymmetrizedCalculator(l_max=L, store_rotational_std=True)``), the
prediction is averaged over rotated copies of the structure: a Lebedev grid on the sphere
(the smallest order available >= L) times 2L+1 equispaced in-plane angles, each rotation
also composed with the inversion, weights normalized to 1. The rule integrates exactly
every function of the rotation whose Wigner components have degree <= L, so the parts of
the model's orientation dependence up to degree L average out. The same quadrature, the
same back-rotation (forces ``F' R``, stress ``R^T S' R``) and the same standard deviations
over rotations as metatomic-ase; here the rotated copies go through one batched model
call per batch (:func:`evaluate_averaged`) instead of a loop of single calls.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from ase import Atoms
from ase.geometry import wrap_positions
from ase.stress import full_3x3_to_voigt_6_stress, voigt_6_to_full_3x3_stress

LEBEDEV_ORDERS = (
    *range(3, 32, 2),  # 3, 5, ..., 31
    35,
    *range(41, 132, 6),  # 41, 47, ..., 131
)
"""The orders of scipy's ``lebedev_rule`` (the degree of spherical harmonics each integrates)."""

MAX_ORDER = LEBEDEV_ORDERS[-1]


def _check_order(order) -> int:
    integer = isinstance(order, (int, np.integer)) and not isinstance(order, bool)
    if not integer or not 1 <= order <= MAX_ORDER:
        raise ValueError(
            f"rotational averaging order must be an integer from 1 to {MAX_ORDER} (the largest "
            f"Lebedev order available), not {order!r}"
        )
    return int(order)


def quadrature(order: int, inversion: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """metatomic-ase's quadrature of O(3) (of SO(3) without ``inversion``) for degree ``order``.

    Lebedev nodes of the smallest order >= ``order`` (scipy's ``lebedev_rule``) give the
    first two ZYZ Euler angles (alpha = atan2(y, x), beta = acos(z)), ``2 * order + 1``
    equispaced angles in [0, 2 pi) the third; with ``inversion`` the same rotations times
    -1 follow, each with half the weight. Exact for every polynomial in the entries of R
    of degree <= ``order``.

    Count of rotations: (Lebedev nodes) x (2 order + 1) x (2 with inversion): order 1 and
    3 use the 6-node grid (1: 6 x 3 x 2 = 36; 3: 6 x 7 x 2 = 84), order 5 the 14-node grid
    (14 x 11 x 2 = 308), order 7 the 26-node grid (26 x 15 x 2 = 780).

    :param order: the degree L to integrate exactly, 1 to 131.
    :param inversion: average over O(3) (proper and improper rotations) instead of SO(3).
    :return: ``rotations`` [B, 3, 3] (float64, orthogonal) and ``weights`` [B] (float64,
        summing to 1).
    """
    from scipy.integrate import lebedev_rule
    from scipy.spatial.transform import Rotation

    order = _check_order(order)
    lebedev = min(o for o in LEBEDEV_ORDERS if o >= order)
    nodes, sphere_weights = lebedev_rule(lebedev)  # nodes [3, M]; weights sum to 4 pi
    x, y, z = nodes
    alpha = np.arctan2(y, x)
    beta = np.arccos(z)
    inplane = 2 * order + 1
    gamma = np.linspace(0.0, 2 * np.pi, inplane, endpoint=False)
    rotations = (
        Rotation.from_euler("z", np.repeat(alpha, inplane).reshape(-1, 1))
        * Rotation.from_euler("y", np.repeat(beta, inplane).reshape(-1, 1))
        * Rotation.from_euler("z", np.tile(gamma, alpha.size).reshape(-1, 1))
    ).as_matrix()
    weights = np.repeat(sphere_weights / (4 * np.pi * inplane), inplane)
    if inversion:
        rotations = np.concatenate([rotations, -rotations])
        weights = np.concatenate([0.5 * weights, 0.5 * weights])
    return rotations, weights / weights.sum()


def rotated(atoms: Atoms, rotations: np.ndarray) -> list[Atoms]:
    """Copies of ``atoms``, the k-th with positions (Å) and cell vectors rotated by
    ``rotations[k]`` (``r -> R r``) and, when it has a cell, atoms wrapped back into it (as
    metatomic-ase's ``_rotate_atoms``, which calls ASE's ``wrap`` on each copy). Rotating
    the positions and the cell together leaves the fractional coordinates as they are, so
    the structure is wrapped once, before the rotations.

    :param atoms: the structure.
    :param rotations: [B, 3, 3] orthogonal matrices.
    :return: B new :class:`~ase.Atoms` (no calculator attached).
    """
    turns = np.swapaxes(np.asarray(rotations, dtype=float), 1, 2)  # r R^T for row vectors r
    has_cell = atoms.cell is not None and atoms.cell.rank > 0
    positions = atoms.positions
    if has_cell and atoms.pbc.any():
        positions = wrap_positions(positions, atoms.cell.array, atoms.pbc)
    positions = positions @ turns  # [B, n, 3]
    cells = atoms.cell.array @ turns  # [B, 3, 3]: each cell vector rotated
    copies = []
    for k in range(len(turns)):
        copy = atoms.copy()
        copy.positions = positions[k]
        if has_cell:
            copy.set_cell(cells[k], scale_atoms=False, apply_constraint=False)
        copies.append(copy)
    return copies


def average(results: Sequence[dict], rotations: np.ndarray, weights: np.ndarray, atoms: Atoms) -> dict:
    """The weighted average over rotated copies, back in the frame of ``atoms``.

    ``results[k]`` is the prediction for ``rotated(atoms, rotations)[k]`` in ASE's
    conventions. For each key all the results have, the average (and, except for
    ``free_energy``, the weighted standard deviation over rotations, metatomic-ase's key
    names):

    - ``energy``, ``free_energy`` (eV, floats); ``energy_rot_std`` (eV)
    - ``energies`` [n] (eV); ``energies_rot_std`` [n]
    - ``forces`` [n, 3] (eV/Å), each copy's back-rotated ``F' R``; ``forces_rot_std`` [n, 3]
    - ``stress`` (eV/Å³) [6] in Voigt order (xx, yy, zz, yz, xz, xy) as the input, each
      copy's back-rotated as a 3 x 3 ``R^T S' R``; ``stress_rot_std`` a **3 x 3** matrix
      (elementwise standard deviation of the back-rotated tensors), as metatomic-ase gives it.

    - ``energy_uncertainty`` [n] (eV): each atom's largest over the copies, no deviation
      (what ``uncertainty_threshold`` is checked against)

    Standard deviations are those of the quadrature: ``sqrt(sum_k w_k (x_k - mean)^2)``.

    :param results: B dicts (as :meth:`~ase_tcfp32.TCPETCalculator.evaluate` returns).
    :param rotations: [B, 3, 3], the rotations that made the copies.
    :param weights: [B] quadrature weights (normalized here).
    :param atoms: the unrotated structure (n atoms).
    """
    rotations = np.asarray(rotations, dtype=float)
    weights = np.asarray(weights, dtype=float)
    count = len(rotations)
    if not (len(results) == count == len(weights)):
        raise ValueError(f"{len(results)} results, {count} rotations and {len(weights)} weights: need one each")
    weights = weights / weights.sum()
    n = len(atoms)
    keys = [key for key in ("energy", "free_energy", "energies", "forces", "stress") if all(key in r for r in results)]

    def mean(x):
        return np.tensordot(weights, x, axes=1)

    def std(x):
        return np.sqrt(np.tensordot(weights, (x - mean(x)) ** 2, axes=1))

    out = {}
    if all("energy_uncertainty" in r for r in results):
        out["energy_uncertainty"] = np.max([np.asarray(r["energy_uncertainty"], dtype=float) for r in results], 0)
    for key in keys:
        values = np.asarray([np.asarray(r[key], dtype=float) for r in results])
        if key in ("energy", "free_energy"):
            values = values.reshape(count)
        elif key == "energies":
            values = values.reshape(count, n)
        elif key == "forces":
            values = values.reshape(count, n, 3) @ rotations  # F' R
        else:  # Voigt stress of each rotated copy, back-rotated as a 3 x 3: R^T S' R
            full = np.array([voigt_6_to_full_3x3_stress(s) if s.shape == (6,) else s.reshape(3, 3) for s in values])
            values = np.swapaxes(rotations, 1, 2) @ full @ rotations
        averaged = mean(values)
        if key in ("energy", "free_energy"):
            out[key] = float(averaged)
        elif key == "stress":
            out[key] = full_3x3_to_voigt_6_stress(averaged)
        else:
            out[key] = averaged
        if key != "free_energy":
            deviation = std(values)
            out[f"{key}_rot_std"] = float(deviation) if key == "energy" else deviation
    return out


def check_batch_size(batch_size) -> None:
    """A clear error for a ``rotational_average_batch_size`` other than None or a positive integer."""
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1
    ):
        raise ValueError(
            f"rotational_average_batch_size is a positive number of copies (a positive integer) or None, "
            f"not {batch_size!r}"
        )


def check(order: int | None, batch_size: int | None) -> None:
    """Clear errors, before any evaluation, for an averaging ``order`` (None or 0: no
    averaging, as upet) or ``batch_size`` that cannot be used."""
    check_batch_size(batch_size)
    if not order:
        if batch_size is not None:
            raise ValueError("rotational_average_batch_size needs rotational_average_order")
        return
    quadrature(order)  # the order's checks


def whole_batches(count: int, size: int, whole: int | None) -> int:
    """Copies per batch for ``count`` copies of ``size`` atoms where one evaluation takes up
    to ``whole`` atoms without going into pieces (None: any number): all at once where they
    fit, else the fewest batches that do, of equal size. A piece-wise evaluation computes each
    GNN layer's forward pass again in the backward pass; batches that fit do not."""
    if whole is None or count * size <= whole:
        return count
    batches = math.ceil(count / max(1, whole // size))
    return math.ceil(count / batches)


def evaluate_averaged(
    evaluate: Callable[[list[Atoms]], list[dict]],
    atoms: Atoms,
    order: int,
    batch_size: int | None = None,
    whole: int | None = None,
) -> dict:
    """The rotational average of ``evaluate``'s prediction for ``atoms``.

    :func:`quadrature` of ``order`` (with inversion), :func:`rotated` copies evaluated in
    batches of ``batch_size`` (one ``evaluate`` call per batch: ``ceil(B / batch_size)``
    calls for B rotations), :func:`average` of the results.

    :param evaluate: many structures -> one result dict each (``energy`` eV, ``energies``
        [n] eV, ``forces`` [n, 3] eV/Å, ``stress`` Voigt eV/Å³ ...), such as
        :meth:`ase_tcfp32.TCPETCalculator.evaluate`.
    :param atoms: the structure (n atoms).
    :param order: the degree L integrated exactly, 1 to 131 (upet's ``rotational_average_order``).
    :param batch_size: copies per ``evaluate`` call (upet's ``rotational_average_batch_size``);
        ``None``: all B at once, or where more than ``whole`` atoms, the fewest equal batches
        of at most ``whole`` (:func:`whole_batches`).
    :param whole: the most atoms ``evaluate`` takes without evaluating them in pieces (None: any).
    :return: :func:`average`'s dict: averages and ``*_rot_std`` standard deviations.
    :raises torch.OutOfMemoryError: a batch did not fit, with advice on what to lower.
    """
    check_batch_size(batch_size)
    rotations, weights = quadrature(order)
    count = len(rotations)
    batch_size = whole_batches(count, len(atoms), whole) if batch_size is None else batch_size
    copies = rotated(atoms, rotations)
    results = []
    for start in range(0, count, batch_size):
        batch = copies[start : start + batch_size]
        try:
            batch_results = list(evaluate(batch))
        except torch.OutOfMemoryError as error:
            batches = math.ceil(count / batch_size)
            raise torch.OutOfMemoryError(
                f"out of memory during rotational averaging, evaluating {len(batch)} rotated copies of "
                f"{len(atoms)} atoms at once (order {order}: {count} rotations in {batches} batch(es)). "
                "Lower rotational_average_batch_size (fewer copies per model call) or "
                f"rotational_average_order (fewer rotations). {error}"
            ) from error
        if len(batch_results) != len(batch):
            raise RuntimeError(f"evaluate returned {len(batch_results)} results for {len(batch)} structures")
        results.extend(batch_results)
    return average(results, rotations, weights, atoms)
