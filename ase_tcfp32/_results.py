"""A batched evaluation's results, structure by structure, as the engines return them.

The lean engine computes all structures of a call at once: per-atom quantities for all
their atoms one after another, per-structure ones in a row each. :func:`per_structure`
splits them into one dict per structure, in ASE's conventions (float64 numpy arrays, the
strain derivatives over each 3D-periodic structure's volume as stress); :class:`Flat`
packs them on the device and brings them to the host in one transfer.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import numpy as np
import torch
from ase import Atoms

PER_ATOM = (
    "energies",
    "forces",
    "non_conservative_forces",
    "energy_features",
    "energy_uncertainty",
    "energy_ensemble_forces",
    "non_conservative_forces_ensemble",
)
"""Results with one row per atom (their first axis runs over all atoms of the call)."""

STRESSES = {"virial": "stress", "energy_ensemble_virial": "energy_ensemble_stress"}
"""Strain derivatives (eV) per structure, and the name of each over the volume (eV/Å³)."""

DIRECT_STRESSES = ("non_conservative_stress", "non_conservative_stress_ensemble")
"""Stresses per structure that the direct stress head gives as such (eV/Å³)."""


def per_structure(host: dict[str, np.ndarray], structures: list[Atoms]) -> list[dict]:
    """One dict per structure of ``structures`` from ``host``, the engine's float64 arrays for
    the whole call: ``energy`` [S] as floats, :data:`PER_ATOM` arrays split by structure,
    and for each 3D-periodic structure the :data:`STRESSES` (over its volume) and the
    :data:`DIRECT_STRESSES` ([S, 3, 3], [S, 3, 3, K]: already stresses)."""
    starts = [0, *itertools.accumulate(len(atoms) for atoms in structures)]
    per_atom = [key for key in PER_ATOM if key in host]
    results = []
    for k, atoms in enumerate(structures):
        result = {"energy": float(host["energy"][k])}
        result.update((key, host[key][starts[k] : starts[k + 1]]) for key in per_atom)
        if atoms.pbc.all():
            volume = atoms.get_volume()
            result.update({name: host[key][k] / volume for key, name in STRESSES.items() if key in host})
            result.update({key: host[key][k] for key in DIRECT_STRESSES if key in host})
        results.append(result)
    return results


class Flat(NamedTuple):
    """A step's results packed on the device into one float64 vector, so that a recorded
    CUDA graph packs them too and the host only copies ``values`` (integers are exact up
    to 2^53)."""

    values: torch.Tensor  # [T] float64: the results' elements one after another
    layout: tuple  # (name, shape) of each result, in order

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> Flat:
        """``tensors`` (any shapes and types, one device) packed."""
        values = torch.cat([tensor.detach().reshape(-1).to(torch.float64) for tensor in tensors.values()])
        return cls(values, tuple((name, tuple(tensor.shape)) for name, tensor in tensors.items()))

    def plus(self, tensors: dict[str, torch.Tensor]) -> Flat:
        """``tensors`` (any shapes and types, this device) packed after these results: one
        vector again, so that the host still copies once."""
        extra = Flat.of(tensors)
        return Flat(torch.cat([self.values, extra.values]), self.layout + extra.layout)

    def _spans(self):
        """Each result's name, shape and its elements' start and end in :attr:`values`."""
        start = 0
        for name, shape in self.layout:
            end = start + math.prod(shape)
            yield name, shape, start, end
            start = end

    def tensor(self, name: str) -> torch.Tensor:
        """The result ``name`` on the device, float64 in its shape: a view of :attr:`values`
        (overwritten where a recorded graph replays into them)."""
        for key, shape, start, end in self._spans():
            if key == name:
                return self.values[start:end].view(shape)
        raise KeyError(f"{name} is not among the results ({', '.join(key for key, _ in self.layout)})")

    def to_host(self) -> dict[str, np.ndarray]:
        """The results as float64 numpy arrays of their shapes, through one device-to-host
        copy: the host waits for the device once per call, not once per result."""
        flat = self.values.cpu().numpy()  # slices: np.split's own overhead is host time in every small step
        return {name: flat[start:end].reshape(shape) for name, shape, start, end in self._spans()}
