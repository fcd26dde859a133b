"""PET on plain tensors with static shapes: the calculator's fast path for MD.

The metatomic path rebuilds everything every step: ASE-side neighbor lists, metatomic
``System`` and ``TensorMap`` objects, and metatrain's neighbor table, whose width (the
largest neighbor count) is read back to the host. Here instead:

- the candidate pairs within ``cutoff + skin`` come from a Verlet list on the model's
  device (:mod:`ase_tcfp32._neighbors`), in a buffer of fixed capacity sorted by center atom;
- each step, on the device only: edge vectors, PET's adaptive per-atom cutoffs (metatrain's
  solver; on CUDA its iterations run in one kernel of ours, :mod:`ase_tcfp32._kernels.cutoffs`),
  and the [atoms, J] neighbor table with J the largest neighbor count plus :data:`MARGIN`,
  checked after the step and widened when an atom outgrows it (J is the length of a
  tensor, not a Python number, so that ``torch.compile`` does not recompile for a new J);
- energy, forces and the strain derivative (stress) from one backward pass: the energy
  depends on positions only through the pair vectors v, so the derivative of structure s's
  energy by its strain is the sum over its pairs of v ⊗ dE/dv (no per-pair cell products
  in the graph: with many structures per call those were ~10% of the step);
- PET's inputs are built from the kept pairs as metatrain's neighbor table or as packed
  rows (:mod:`ase_tcfp32._inputs`);
- for systems of up to ``graph_atoms`` atoms the step is recorded once per (capacity, J)
  as a CUDA graph and replayed (:mod:`ase_tcfp32._graphs`): no kernel launches from Python
  while atoms move.

Pairs beyond the adaptive cutoff contribute exactly zero to metatrain's solver (its
smooth count is flat there), so the skin changes nothing; results agree with the
metatomic path to FP32 rounding (``tests/test_lean.py``).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from ase import Atoms

from . import _progress as progress
from . import watchdog
from ._compilation import compiled
from ._graphs import Graph
from ._heads import ENERGY, FORCE, LLPR, STRESS, Heads, direct_output, per_structure_sums, table_predictions
from ._inputs import Kept, neighbor_table, packed_rows
from ._kernels.context import cutoff_kernel_usable
from ._neighbors import PairTerms, Structures, VerletList, pair_vectors, round_up, uploaded, virials
from ._results import Flat, per_structure
from ._uncertainty import LLPR_OUTPUTS, Uncertainty, features_for

_FAR = 1.0e6
"""Distance given to the padding pairs: past every cutoff, so they weigh exactly zero."""

MARGIN = 2
"""Columns of the neighbor table beyond the largest neighbor count, so that counts can
grow by that much before a step is redone with a wider table. Every column costs ~1/J of
the edge work (GEMMs and attention): metatrain's own table has no margin."""


ROW_SPARE = 0.02
"""Packed rows (:mod:`ase_tcfp32._packed`) beyond the kept pairs, as a fraction of them, so that their
number can grow by that much before a step is redone with more rows (and a CUDA graph recorded anew)."""


def unsupported_reason(pet: torch.nn.Module) -> str | None:
    """Why the lean path cannot evaluate this metatrain PET exactly, or None."""
    from metatrain.composition import CompositionModel

    if pet.long_range:
        return "it has a long-range (Ewald/P3M) module"
    if pet.backend.system_conditioning is not None:
        return "it is conditioned on charge and spin"
    others = [type(m).__name__ for m in pet.additive_models if not isinstance(m, CompositionModel)]
    if others:
        return f"it has additive models other than composition ({', '.join(others)})"
    if pet.dataset_info.length_unit.lower() not in ("", "angstrom", "a"):  # "": no unit, no conversion
        return f"its length unit is {pet.dataset_info.length_unit!r}, not Å"
    if pet.dataset_info.targets["energy"].unit not in ("", "eV"):
        return f"its energy unit is {pet.dataset_info.targets['energy'].unit!r}, not eV"
    return None


class LeanPET:
    """Energy, forces and stress of a metatrain PET on plain tensors (see module doc).

    :param pet: a metatrain PET in eval mode (its Linear layers in any precision).
    :param device: where to evaluate it (the model is moved there).
    :param skin: Verlet skin in Å.
    :param graph_atoms: record the step of systems with up to this many atoms as a CUDA
        graph and replay it (CUDA only; 0: never).
    :param large_skin: the skin (Å) for systems of more than ``graph_atoms`` atoms
        (default ``skin``).
    :param compile: run :meth:`neighbor_table` (adaptive cutoffs included) through
        ``torch.compile``; the model's own stages are compiled by the calculator.
    :param check_every: with graphs, every this many evaluations (the first included) run
        eagerly with every watched layer checked (:mod:`ase_tcfp32.watchdog`: a replayed
        graph runs no Python); 0: never.
    :param heads: the heads to read (:class:`ase_tcfp32._heads.Heads`; default: the
        model's default energy, and its direct heads where it has them).
    :param packed: evaluate PET on packed rows, without the table's padding
        (:mod:`ase_tcfp32._packed`: its attention on tensor cores; not with ``compile``).
    :param pieces: on packed rows, when to evaluate a system in pieces, one GNN layer at a
        time (:class:`ase_tcfp32._layerwise.Pieces`; None: never).
    :param llpr: the checkpoint's LLPR, for ``energy_uncertainty``, ``energy_ensemble`` and
        the direct heads' ensembles (:mod:`ase_tcfp32._uncertainty`); None: the model has none.
    """

    def __init__(
        self,
        pet: torch.nn.Module,
        device: torch.device,
        skin: float = 2.0,
        graph_atoms: int = 0,
        large_skin: float | None = None,
        compile: bool = False,
        check_every: int = 0,
        packed: bool = False,
        heads: Heads | None = None,
        pieces=None,
        llpr: LLPR | None = None,
    ):
        from metatrain.pet.modules import adaptive_cutoff, utilities

        reason = unsupported_reason(pet)
        if reason is not None:
            raise ValueError(f"the lean path cannot evaluate this model: {reason}")
        if packed:
            from ._packed import unsupported_reason as packed_problem

            reason = packed_problem(pet) or ("compile=True compiles the table's path" if compile else None)
            if reason is not None:
                raise ValueError(f"packed rows cannot evaluate this model: {reason}")
        if graph_atoms and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not '{device}'")
        self.heads = (heads or Heads(pet)).to(device)  # scales and offsets in float64: exact sums of large offsets
        self.pet, self.device, self.graph_atoms = pet.to(device), device, graph_atoms
        self.backend = pet.backend
        self.dtype = next(pet.parameters()).dtype
        self.uncertainty = Uncertainty(llpr, device, self.dtype, self.backend, self.heads)
        self.skins = (float(skin), float(skin if large_skin is None else large_skin))
        self.neighbors = VerletList(float(self.backend.cutoff), device, self.dtype)
        self.cuda_graphs = False  # set per system, with the skin
        self.system = torch.zeros(0, dtype=torch.long, device=device)  # [N] the structure of each atom
        self.numbers, self.unweighted = self.system, self.system.double()  # [N] atomic numbers, ones (set per system)
        self.columns = torch.arange(0, device=device)  # [J]: the neighbor table's columns
        self.packed, self.rows, self.pieces = packed, 0, pieces  # PET on packed rows (ase_tcfp32._packed), in this many
        self.widenings = 0
        self.evaluations = 0
        self.recordings = 0  # CUDA graphs recorded
        self.check_every = check_every
        self._graphs: dict[tuple, Graph] = {}  # by the outputs they compute (MTS alternates two)
        self._far = torch.tensor([_FAR, 0.0, 0.0], device=device, dtype=self.dtype)  # here: no host copy in a graph
        solver = self.backend.adaptive_cutoff_method.lower() == "solver"
        self._adaptive_cutoffs = (
            adaptive_cutoff.get_adaptive_cutoffs_solver if solver else adaptive_cutoff.get_adaptive_cutoffs_grid
        )
        self._solver_kernel = None  # the solver's iterations in one kernel of ours: on CUDA, in FP32
        if solver and self.dtype == torch.float32 and cutoff_kernel_usable(device):
            from ._kernels.cutoffs import adaptive_cutoffs

            self._solver_kernel = functools.partial(adaptive_cutoffs, bump=utilities.cutoff_func_bump)
        bump = self.backend.cutoff_function.lower() == "bump"
        self._cutoff_function = utilities.cutoff_func_bump if bump else utilities.cutoff_func_cosine
        if compile:
            self.neighbor_table = compiled(self.neighbor_table)

    @property
    def pairs(self):
        """The current candidate pairs (:class:`ase_tcfp32._neighbors.Pairs`)."""
        return self.neighbors.pairs

    @property
    def skin(self) -> float:
        """The Verlet skin (Å) of the current system."""
        return self.neighbors.skin

    @property
    def rebuilds(self) -> int:
        """Neighbor lists built so far."""
        return self.neighbors.rebuilds

    def _use(self, batch: Structures, reach: float = 0.5) -> None:
        """Pairs for ``batch``: a new system gets its skin, graph policy and table anew; a list
        stale by ``reach`` (:meth:`VerletList.stale`) is rebuilt (into the graphs' buffers if they fit)."""
        if self.neighbors.new_system(batch):
            sizes = torch.tensor(batch.sizes)
            self.system = torch.repeat_interleave(torch.arange(len(sizes)), sizes).to(self.device)
            self.numbers = torch.from_numpy(batch.numbers).to(self.device, torch.long)  # copied once per system
            self.unweighted = torch.ones(len(batch.numbers), dtype=torch.float64, device=self.device)
            pieces = self.pieces is not None and len(batch.numbers) > self.pieces.above  # no host reads in a graph
            self.cuda_graphs = len(batch.numbers) <= self.graph_atoms and not pieces
            self.neighbors.skin = self.skins[0] if self.cuda_graphs else self.skins[1]
            self._set_width(0)
        if self.neighbors.stale(batch, reach) and not self.neighbors.update(batch, in_place=bool(self._graphs)):
            self._graphs = {}

    @property
    def width(self) -> int:
        """J, the neighbor table's width (0 before the first evaluation)."""
        return self.columns.numel()

    def _set_width(self, width: int) -> None:
        """A table of ``width`` columns from the next evaluation on (not the recorded graphs')."""
        self.columns, self._graphs = torch.arange(width, device=self.device), {}

    def _set_rows(self, pairs: int) -> None:
        """Rows for ``pairs`` kept pairs and :data:`ROW_SPARE` more, from the next evaluation on."""
        self.rows, self._graphs = round_up(int(pairs * (1 + ROW_SPARE)) + 64, 256), {}

    # ----- one evaluation on tensors ----------------------------------------------------

    def _kept_pairs(self, vectors: torch.Tensor, n: int) -> Kept:
        """Pairs PET keeps (adaptive cutoffs), their cutoff factors, for their ``vectors`` [capacity, 3], N = ``n``."""
        backend, pairs = self.backend, self.pairs
        vectors = torch.where(pairs.valid[:, None], vectors, self._far)
        distances = torch.norm(vectors, dim=-1) + 1e-15

        if backend.num_neighbors_adaptive is not None:
            if self._solver_kernel is not None:
                atomic = self._solver_kernel(
                    pairs.centers,
                    distances,
                    pairs.first,
                    backend.num_neighbors_adaptive,
                    backend.cutoff,
                    self.pet.cutoff_width_adaptive,
                )
            else:
                atomic = self._adaptive_cutoffs(
                    pairs.centers,
                    distances,
                    backend.num_neighbors_adaptive,
                    n,
                    backend.cutoff,
                    cutoff_width=self.pet.cutoff_width_adaptive,
                )
            pair_cutoffs = (
                PairTerms.apply(atomic, pairs.centers, pairs.neighbors, pairs.reverse, pairs.first, 1.0) / 2.0
            )
        else:
            pair_cutoffs = torch.full_like(distances, backend.cutoff)
        keep = (distances <= pair_cutoffs) & pairs.valid
        factors = self._cutoff_function(distances, pair_cutoffs, backend.cutoff_width)
        before = torch.nn.functional.pad(torch.cumsum(keep.long(), 0), (1, 0))  # [capacity + 1]: kept before k
        counts = before[pairs.first[1:]] - before[pairs.first[:-1]]
        return Kept(vectors, factors, keep, before, counts)

    def neighbor_table(self, vectors: torch.Tensor, numbers: torch.Tensor, columns: torch.Tensor) -> tuple:
        """:func:`ase_tcfp32._inputs.neighbor_table` for the current pairs' ``vectors``
        [capacity, 3] and the atomic ``numbers`` [N] (adaptive cutoffs included)."""
        kept = self._kept_pairs(vectors, numbers.shape[0])
        return neighbor_table(kept, self.pairs, self.backend.species_to_species_index[numbers], columns)

    def predict(
        self,
        vectors: torch.Tensor,
        cells: torch.Tensor,
        numbers: torch.Tensor,
        direct: tuple[str, ...],
        features: tuple[str, ...] = (),
        energy: bool = True,
    ) -> tuple:
        """Per-atom energies [N] (eV, float64: PET's output, scaled and offset in float64; None without
        ``energy``), the ``direct`` heads' per-atom predictions (float64, scaled; [N, 3] and [N, 9]), the sizes
        the step needed (a tensor [2]: the largest neighbor count and, on packed rows, the kept pairs' number)
        and the last-layer features [N, F] of the heads among ``features`` (a dict by head), for the pair
        ``vectors`` [capacity, 3] of atoms of atomic ``numbers`` [N] in structures of ``cells`` [S, 3, 3]."""
        quantities = (ENERGY, *direct) if energy else direct
        heads = [self.heads[quantity] for quantity in quantities]
        features = [head.name for quantity, head in zip(quantities, heads) if quantity in features]
        if self.packed:
            from ._layerwise import predictions  # the whole system, or in pieces

            species = self.backend.species_to_species_index[numbers]
            kept = self._kept_pairs(vectors, numbers.shape[0])
            inputs, most, total = packed_rows(kept, self.pairs, species, self.columns, self.rows)
            outputs, found = predictions(self.backend, inputs, [head.name for head in heads], features, self.pieces)
        else:
            batch, most = self.neighbor_table(vectors, numbers, self.columns)
            nodes, edges = self.backend.calculate_features(batch)
            outputs, found = table_predictions(self.backend, nodes, edges, batch, [h.name for h in heads], features)
            total = torch.zeros_like(most)
        scaled = [
            out.double() * head.scale[numbers][:, None] + head.offset[numbers][:, None]
            for out, head in zip(outputs, heads)
        ]
        energies = scaled.pop(0)[:, 0] if energy else None  # the energy head's
        return energies, scaled, torch.stack([most, total]), dict(zip(quantities, found))

    def _step(
        self,
        positions: torch.Tensor,
        cells: torch.Tensor,
        numbers: torch.Tensor,
        system: torch.Tensor,
        weights: torch.Tensor,
        grad: bool,
        stress: bool,
        direct: tuple[str, ...],
        llpr: tuple[str, ...] = (),
        energy: bool = True,
    ) -> Flat:
        """One evaluation on the device, results packed (:class:`~ase_tcfp32._results.Flat`): with ``energy`` the
        per-structure energies [S] (per-atom energies [N] times ``weights`` [N], summed), with ``grad`` the forces
        [N, 3] (``stress``: strain derivatives [S, 3, 3]) by one backward pass; the ``direct`` heads' forces [N, 3]
        (no net force) and stress [S, 3, 3]; the ``llpr`` outputs (:meth:`~ase_tcfp32._uncertainty.Uncertainty.outputs`)."""
        positions = positions.detach().requires_grad_(grad)
        count = cells.shape[0]
        with torch.set_grad_enabled(grad):
            vectors = pair_vectors(positions, self.pairs)
            energies, terms, sizes, found = self.predict(vectors, cells, numbers, direct, features_for(llpr), energy)
            out = {"sizes": sizes}
            if energy:  # without it (inner steps of multiple time stepping), its head is not read
                weighted = energies * weights
                out.update(energy=per_structure_sums(weighted.detach(), system, count), energies=energies.detach())
            if grad:
                wrt = [positions, vectors] if stress else [positions]
                grads = torch.autograd.grad(weighted.sum(), wrt, retain_graph="energy_ensemble" in llpr)
                out["forces"] = -grads[0]
            if grad and stress:  # dE/d(strain) of structure s: its pairs' v ⊗ dE/dv, summed (see the module doc)
                out["virial"] = virials(vectors, grads[1], self.pairs, count)
            for quantity, term in zip(direct, terms):
                out.update(direct_output(quantity, term.detach(), cells, system))
            if llpr:
                virial = functools.partial(virials, pairs=self.pairs, count=count) if stress else None
                out.update(self.uncertainty.outputs(llpr, found, out, positions, system, vectors, virial))
        return Flat.of(out)  # packed in the step: a recorded graph packs them too

    # ----- the engine interface -----------------------------------------------------------

    def compute(self, structures: list[Atoms], properties, weights: list | None = None) -> list[dict]:
        """Per structure, as float64 numpy arrays: ``energy`` (eV) and ``energies`` [n] (eV) always; ``forces``
        [n, 3] (eV/Å) when ``"forces"`` or ``"stress"`` is asked (one backward pass; none for an energy-only call);
        ``stress`` [3, 3] (eV/Å³, ASE sign) of each 3D-periodic structure when ``"stress"`` is asked; the direct
        heads' ``non_conservative_forces`` [n, 3] and, for 3D-periodic structures, ``non_conservative_stress``
        [3, 3] when asked; the LLPR outputs when asked (:data:`ase_tcfp32._uncertainty.LLPR_OUTPUTS`); with
        ``weights`` ([n] per structure) ``energy``, forces and stress are those of the per-atom energies'
        weighted sum. One batched evaluation (same-size copies, like path-integral beads, are the fast case)."""
        flags = self.flags(structures, properties)
        batch = Structures.of(structures)
        self._use(batch)
        positions, cells = (uploaded(array, self.device, self.dtype) for array in (batch.positions, batch.cells))
        numbers, system = self.numbers, self.system
        weights = self.unweighted if weights is None else torch.from_numpy(np.concatenate(weights))
        weights = weights.to(self.device, torch.float64)  # the ones: as they are
        if self.width == 0:  # first call: size the table (or the packed rows) from the neighbor counts
            if self.packed:
                counts = self.neighbor_counts(structures)
                most = int(counts.max())
                self._set_rows(int(counts.sum()))
            else:
                self._set_width(8)  # not 1: the compiler would specialise a length of 1
                with torch.enable_grad():  # the step's grad mode: with compile=True, no second compilation
                    most = int(self.neighbor_table(pair_vectors(positions, self.pairs), numbers, self.columns)[1])
            self._set_width(most + MARGIN)
        host = self._evaluate(positions, cells, numbers, system, weights, flags).to_host()
        most, total = map(int, host.pop("sizes"))
        if most > self.width or total > self.rows:  # an atom outgrew the table, or the pairs the rows: redo the step
            if most > self.width:
                self._set_width(most + MARGIN)
                self.widenings += 1
            if total > self.rows:
                self._set_rows(total)
            host = self._evaluate(positions, cells, numbers, system, weights, flags).to_host()  # same counts, any sizes
            host.pop("sizes")
        return per_structure(host, structures)

    def flags(self, structures: list[Atoms], properties) -> dict:
        """:meth:`_step`'s keyword arguments for :meth:`compute`'s ``properties`` of ``structures``."""
        stress = "stress" in properties and any(atoms.pbc.all() for atoms in structures)
        named = ((FORCE, "non_conservative_forces"), (STRESS, "non_conservative_stress"))
        direct = tuple(quantity for quantity, name in named if name in properties or f"{name}_ensemble" in properties)
        llpr = self.uncertainty.check(name for name in LLPR_OUTPUTS if name in properties)
        grad = "forces" in properties or "stress" in properties or "energy_ensemble" in llpr
        return {"grad": grad, "stress": stress, "direct": direct, "llpr": llpr}

    def neighbor_counts(self, structures: list[Atoms]) -> torch.Tensor:
        """The neighbors [N] that PET keeps for each atom of ``structures`` (within its adaptive cutoffs): the
        lengths of its attention sequences, less the center token."""
        batch = Structures.of(structures)
        self._use(batch)
        positions = uploaded(batch.positions, self.device, self.dtype)
        return self._kept_pairs(pair_vectors(positions, self.pairs).detach(), positions.shape[0]).counts

    def _evaluate(self, positions, cells, numbers, system, weights, flags: dict) -> Flat:
        """One :meth:`_step` with ``flags``: eager, or replaying the graph recorded (once) for them."""
        due = self.check_every and self.evaluations % self.check_every == 0
        self.evaluations += 1
        if not self.cuda_graphs or any(name.endswith("_ensemble") for name in flags["llpr"]):  # one-offs: no graph
            return self._step(positions, cells, numbers, system, weights, **flags)
        if due:  # the watchdog's turn: the same step, eagerly, every layer checked
            with watchdog.check_all():
                return self._step(positions, cells, numbers, system, weights, **flags)
        key = tuple(flags.values())
        if key not in self._graphs:  # recorded once per shape for each set of outputs asked
            torch.cuda.synchronize(self.device)
            with progress.doing(f"recording a CUDA graph ({positions.shape[0]} atoms, table width {self.width})"):
                step = functools.partial(self._step, **flags)
                self._graphs[key] = Graph(step, (positions, cells, numbers, system, weights), self.device)
            self.recordings += 1
        return self._graphs[key].replay(positions, cells, numbers, system, weights)
