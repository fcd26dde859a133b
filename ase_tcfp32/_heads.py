"""PET's readouts: the heads a calculation asks for, their scales and offsets.

PET predicts each target atom by atom: a node head reads the atom's own features and an edge
head each of its neighbor rows, whose results, weighted by the cutoff factors, add to the
atom's (metatrain's ``PETBackend.predict``). After PET, metatrain's scaler multiplies each
target by a scale (per atomic type for per-atom targets) and its composition model adds a
per-type energy. PET-MAD >= 1.1 has three such targets, each possibly in several variants
(``"energy/r2scan"``, ...):

- ``energy``: per-atom energies [N] (eV), whose positions gradient gives the conservative
  forces and whose strain derivative the stress;
- ``non_conservative_force``: direct forces [N, 3] (eV/Å), one forward pass, no backward;
- ``non_conservative_stress``: per-atom terms [N, 3, 3] whose symmetrized sum over a
  structure's atoms, divided by its volume, is the direct stress (eV/Å³).

:class:`Heads` resolves the names (variants, missing heads as clear errors) and holds each
head's per-type scale and offset; :func:`readout` applies a head to packed rows.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

import torch

from . import _epilogues

ENERGY, FORCE, STRESS = "energy", "non_conservative_force", "non_conservative_stress"
"""metatrain's target names of PET-MAD's three heads."""

COMPONENTS = {ENERGY: 1, FORCE: 3, STRESS: 9}
"""Numbers per atom of each head's prediction."""


def target_name(pet: torch.nn.Module, quantity: str, variant: str | None) -> str:
    """metatrain's name of ``quantity``'s output in ``variant`` (``None``: the default one),
    or a clear error naming what the model has."""
    name = quantity if variant is None else f"{quantity}/{variant}"
    if name in pet.output_shapes:
        return name
    have = sorted(key for key in pet.output_shapes if key == quantity or key.startswith(quantity + "/"))
    what = {ENERGY: "energy", FORCE: "direct (non-conservative) forces", STRESS: "direct (non-conservative) stress"}
    if not have:
        raise ValueError(
            f"this model has no {what[quantity]} head (no '{quantity}' output): PET-MAD has them from version "
            "1.1; use the conservative forces and stress (non_conservative=False)"
        )
    raise ValueError(f"this model has no output {name!r}: its {what[quantity]} outputs are {', '.join(have)}")


class Head(NamedTuple):
    """One target's readout after PET: ``prediction * scale[Z] + offset[Z]`` per atom."""

    name: str  # metatrain's target name, e.g. "energy" or "non_conservative_force/pbe"
    components: int  # 1, 3 or 9 numbers per atom
    scale: torch.Tensor  # [Zmax + 1] float64: the scaler's factor of each atomic number
    offset: torch.Tensor  # [Zmax + 1] float64: the composition model's energy (zero but for energies)


def _per_type(pet: torch.nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-atom scale and additive offset of target ``name`` for every atomic type, indexed
    by atomic number: what metatrain's scaler and composition model apply after PET."""
    from metatomic.torch import ModelOutput, System

    types = torch.tensor(pet.atomic_types, dtype=torch.int32)
    dtype = next(pet.parameters()).dtype
    positions = 10.0 * torch.arange(3 * len(types), dtype=dtype).reshape(-1, 3)  # isolated atoms
    system = System(
        types=types, positions=positions, cell=torch.zeros(3, 3, dtype=dtype), pbc=torch.zeros(3, dtype=torch.bool)
    )
    request = {name: ModelOutput(sample_kind="atom")}
    scale = torch.zeros(int(types.max()) + 1, dtype=torch.float64)
    offset = torch.zeros_like(scale)
    block = pet.scaler.get_scales([system], request)[name].block()
    values = block.values.reshape(len(block.values), -1).double()
    if not torch.all(values == values[:, :1]):
        raise ValueError(f"the scaler of {name!r} differs between components: not supported")
    scale[types[block.samples.column("atom").long()].long()] = values[:, 0]
    for model in pet.additive_models:
        if name in model.outputs:
            if name.split("/")[0] != ENERGY:
                raise ValueError(f"an additive model for {name!r}: not supported")
            block = model([system], request)[name].block()
            offset[types[block.samples.column("atom").long()].long()] += block.values[:, 0].double()
    return scale, offset


class Heads:
    """The heads of ``pet`` that a calculator reads: the energy in ``variants["energy"]``
    and, when the model has them, the direct force and stress heads in their variants
    (metatomic-ase's rule: a quantity's variant defaults to the energy's).

    :param variants: ``{"energy": ..., "non_conservative_force": ...,
        "non_conservative_stress": ...}``, each a variant name or ``None`` (the default
        output); missing keys follow ``"energy"``.
    :param direct: the direct heads that must exist (``FORCE``, ``STRESS``); a model
        without one raises a clear error.
    """

    def __init__(self, pet: torch.nn.Module, variants: dict | None = None, direct: tuple[str, ...] = ()):
        variants = dict(variants or {})
        unknown = sorted(set(variants) - set(COMPONENTS))
        if unknown:
            raise ValueError(f"variants for unknown outputs {unknown}: use the keys {', '.join(COMPONENTS)}")
        default = variants.get(ENERGY)
        self.variants = variants
        self.names: dict[str, str] = {ENERGY: target_name(pet, ENERGY, default)}
        for quantity in (FORCE, STRESS):
            variant = variants.get(quantity, default)
            if quantity in direct:
                self.names[quantity] = target_name(pet, quantity, variant)
            elif (quantity if variant is None else f"{quantity}/{variant}") in pet.output_shapes:
                self.names[quantity] = target_name(pet, quantity, variant)
        self.heads = {
            quantity: Head(name, COMPONENTS[quantity], *_per_type(pet, name)) for quantity, name in self.names.items()
        }

    def __getitem__(self, quantity: str) -> Head:
        if quantity not in self.heads:
            raise ValueError(f"this model has no {quantity!r} head")
        return self.heads[quantity]

    def to(self, device: torch.device) -> Heads:
        """The same heads with their scales and offsets on ``device``."""
        for quantity, head in self.heads.items():
            self.heads[quantity] = head._replace(scale=head.scale.to(device), offset=head.offset.to(device))
        return self


def readout(
    backend: torch.nn.Module,
    name: str,
    nodes: torch.Tensor,
    edges: torch.Tensor,
    factors: torch.Tensor,
    real: torch.Tensor,
    centers: torch.Tensor,
    features: bool = False,
) -> tuple:
    """``(prediction, features)``: PET's per-atom prediction [N, C] of target ``name`` from
    the last GNN layer's node features [N, d_node] and edge features [R, d] on packed rows (``factors`` [R] their
    cutoff factors, ``real`` [R] which rows hold a pair, ``centers`` [R] each row's atom),
    before the scaler: the node head's result plus the cutoff-weighted edge heads' results
    summed over each atom's rows, as metatrain's readout does over its table; and with
    ``features`` the head's last-layer features [N, 2 d_head] (the node head's, then the
    edge heads' weighted sum: metatrain's ``mtt::aux::<name>_last_layer_features``), else None."""
    node_last, edge_last = (
        next(iter(layers[name][0].values())) for layers in (backend.node_last_layers, backend.edge_last_layers)
    )
    node_features = _epilogues.head(backend.node_heads[name][0], nodes)
    edge_features = _epilogues.head(backend.edge_heads[name][0], edges)
    per_atom = node_last(node_features)
    edge_terms = torch.where(real[:, None], edge_last(edge_features), 0.0) * factors[:, None]
    prediction = per_atom + torch.zeros_like(per_atom).index_add_(0, centers, edge_terms)
    if not features:
        return prediction, None
    weighted = torch.where(real[:, None], edge_features, 0.0) * factors[:, None]
    summed = node_features.new_zeros(node_features.shape[0], weighted.shape[1]).index_add_(0, centers, weighted)
    return prediction, torch.cat([node_features, summed], dim=1)


def readout_table(
    backend: torch.nn.Module,
    name: str,
    nodes: list[torch.Tensor],
    edges: list[torch.Tensor],
    factors: torch.Tensor,
    mask: torch.Tensor,
    features: bool = False,
) -> tuple:
    """:func:`readout` on metatrain's neighbor table: from each GNN layer's node features
    [N, d_node] and edge features [N, J, d] (``factors`` [N, J] the cutoff factors,
    ``mask`` [N, J] the real slots), summed over the layers in metatrain's order, and with
    ``features`` every layer's last-layer features, node then edge, side by side (else None)."""
    total, found = None, []
    for layer, (node_features, edge_features) in enumerate(zip(nodes, edges, strict=True)):
        node_last, edge_last = (
            next(iter(layers[name][layer].values())) for layers in (backend.node_last_layers, backend.edge_last_layers)
        )
        node_heads = backend.node_heads[name][layer](node_features)
        edge_heads = backend.edge_heads[name][layer](edge_features)
        node_terms = node_last(node_heads)
        edge_terms = (torch.where(mask[..., None], edge_last(edge_heads), 0.0) * factors[..., None]).sum(dim=1)
        total = node_terms + edge_terms if total is None else total + node_terms + edge_terms
        found += [node_heads, (edge_heads * factors[..., None]).sum(dim=1)] if features else []
    return total, torch.cat(found, dim=1) if features else None


def table_predictions(
    backend: torch.nn.Module, nodes: list, edges: list, batch: dict, names: list[str], features: Collection[str] = ()
) -> tuple:
    """:func:`readout_table` of each target of ``names`` from metatrain's features and its
    ``batch`` (the table): the predictions, and the last-layer features of each target
    (None for those not among ``features``), both lists in the order of ``names``."""
    factors, mask = batch["cutoff_factors"], batch["padding_mask"]
    out = [readout_table(backend, name, nodes, edges, factors, mask, name in features) for name in names]
    return [prediction for prediction, _ in out], [found for _, found in out]


def per_structure_sums(values: torch.Tensor, system: torch.Tensor, count: int) -> torch.Tensor:
    """The sums [count, ...] over each structure's atoms of ``values`` [N, ...] of atoms in
    structures ``system`` [N]; no host synchronisation, so it runs in a CUDA graph."""
    return values.new_zeros((count, *values.shape[1:])).index_add_(0, system, values)


def per_structure_centred(values: torch.Tensor, system: torch.Tensor, count: int) -> torch.Tensor:
    """``values`` [N, ...] of atoms in structures ``system`` [N] (of ``count``), less each
    structure's mean over its atoms (a force's net force), graph-safe like :func:`per_structure_sums`."""
    atoms = per_structure_sums(values.new_ones(values.shape[0]), system, count).clamp_min(1)
    sums = per_structure_sums(values, system, count)
    return values - (sums / atoms.reshape(-1, *[1] * (values.dim() - 1))).index_select(0, system)


def direct_output(quantity: str, term: torch.Tensor, cells: torch.Tensor, system: torch.Tensor) -> dict:
    """The direct head ``quantity``'s result from its scaled per-atom predictions ``term``
    of atoms in structures ``system`` [N] of ``cells`` [S, 3, 3]: ``non_conservative_forces``
    [N, 3] with no net force per structure (as metatomic-ase makes them), or
    ``non_conservative_stress`` [S, 3, 3], the per-atom terms over the volume, symmetrized
    and summed per structure (metatrain's rule; a zero volume counts as infinite)."""
    count = cells.shape[0]
    if quantity == FORCE:
        return {"non_conservative_forces": per_structure_centred(term, system, count)}
    cells = cells.to(term.dtype)  # the volumes as triple products: no solver (and no host sync) in a CUDA graph
    volumes = torch.abs((cells[:, 0] * torch.linalg.cross(cells[:, 1], cells[:, 2])).sum(-1))
    volumes = torch.where(volumes == 0, torch.inf, volumes)
    term = term.reshape(-1, 3, 3) / volumes.index_select(0, system)[:, None, None]
    term = (term + term.transpose(1, 2)) / 2
    return {"non_conservative_stress": per_structure_sums(term, system, count)}


class LLPR(NamedTuple):
    """metatrain's last-layer prediction rigidity of the energy (the uncertainty PET-MAD
    releases carry): for last-layer features f (per atom, or summed over a structure's
    atoms), ``sigma = multiplier * |L^-1 f|`` with L the Cholesky factor of the calibrated
    covariance, and the ensemble members ``W f`` re-centred on the prediction. ``direct``:
    the ensembles metatrain's LLPR also keeps of the direct heads, by target name, each
    member's last layer for the head's C components (member k's component c in row
    ``k * C + c``; :mod:`ase_tcfp32._uncertainty`)."""

    cholesky: torch.Tensor  # [F, F] float64, lower triangular
    multiplier: float
    weights: torch.Tensor | None  # [K, F] float64: the ensemble's last layers
    direct: dict[str, torch.Tensor]  # target name -> [K * C, F] float64

    @classmethod
    def of(cls, wrapper: torch.nn.Module | None) -> LLPR | None:
        """The energy's LLPR of a metatrain LLPR model (None for none, or one without it)."""
        if wrapper is None or not hasattr(wrapper, "_get_cholesky"):
            return None
        try:
            cholesky = wrapper._get_cholesky("energy_uncertainty").detach().double().cpu()
            multiplier = float(wrapper._get_multiplier("energy_uncertainty").reshape(-1)[0])
        except (KeyError, AttributeError, RuntimeError):
            return None
        layers = getattr(wrapper, "llpr_ensemble_layers", {})
        weights = layers["energy"].weight.detach().double().cpu() if "energy" in layers else None
        direct = {
            name: layer.weight.detach().double().cpu()
            for name, layer in layers.items()
            if name.split("/")[0] in (FORCE, STRESS)
        }
        return cls(cholesky, multiplier, weights, direct)

    def uncertainty(self, features: torch.Tensor) -> torch.Tensor:
        """sigma (eV) of each row of ``features`` [M, F]: [M]."""
        solved = torch.linalg.solve_triangular(self.cholesky, features.double().T, upper=False)
        return self.multiplier * torch.sqrt((solved**2).sum(0))

    def ensemble(self, features: torch.Tensor, predictions: torch.Tensor) -> torch.Tensor:
        """The ensemble [M, K] (eV) of rows ``features`` [M, F] whose predictions are
        ``predictions`` [M]: its mean is the prediction."""
        if self.weights is None:
            raise ValueError("this model's LLPR has no ensemble")
        members = features.double() @ self.weights.T
        return members - members.mean(1, keepdim=True) + predictions.double()[:, None]
