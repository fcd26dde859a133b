"""Neighbor lists on the model's device: the candidate pairs of a batch of structures.

- :func:`build_pairs` finds the pairs within a distance (vesin; on a GPU, small periodic
  cells of one size through :mod:`ase_tcfp32._kernels.pairs`, or :func:`all_pairs` in a
  batch with others), sorted by center atom, each with its reverse pair, padded to a fixed
  capacity;
- :class:`VerletList` keeps them while no atom has moved more than half the skin;
- :func:`pair_vectors` turns positions into the pairs' vectors with a backward pass that is
  one gather and one segment sum (:class:`PairTerms`, :func:`segment_sum`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from ase import Atoms

from ._kernels.context import INTERPRETED
from .precision import triton_build_problem

VIRIAL_BINS = 256
"""Partial sums per structure of the pairs' virial terms: pair k adds into bin k mod 256 of its
structure, so that millions of atomic additions do not queue on a structure's nine numbers."""


class NeighborListError(RuntimeError):
    """vesin could not compute the neighbor list (on this device)."""


class Pairs(NamedTuple):
    """Candidate pairs i -> j (+ cell shift) within cutoff + skin, sorted by i, padded."""

    centers: torch.Tensor  # [E] int64 (padding: 0)
    neighbors: torch.Tensor  # [E] int64
    shifts: torch.Tensor  # [E, 3] int64 cell shifts
    offsets: torch.Tensor  # [E, 3] shifts times the pair's cell (Å; float64 here, the model's dtype in use)
    bins: torch.Tensor  # [E] int64 where the pair's term of its structure's virial is summed (see VIRIAL_BINS)
    reverse: torch.Tensor  # [E] int64 index of the pair j -> i with the opposite shift
    valid: torch.Tensor  # [E] bool, False for the padding
    first: torch.Tensor  # [N + 1] int64: atom a's pairs are first[a] .. first[a + 1] - 1
    count: int  # real pairs


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


ALL_PAIRS_LIMIT = 1 << 22
"""Largest atoms² x cell images of a 3D-periodic structure whose pairs :func:`all_pairs`
finds on a GPU (every atom pair and image compared at once), and of the structures it
compares in one go (~100 MB of float64 pair vectors); larger or not fully periodic
structures, and every structure on a CPU (where vesin's cell lists are faster: 10 against
32 ms for 192 water atoms on the CI machine), go to vesin. On an H200 vesin costs ~1.3 ms
per structure whatever its size: 40 ms of pair searches for a new list of 32 beads of 192
atoms, half a step, every few path-integral steps."""


def images_needed(cell: np.ndarray, cutoff: float) -> list[int]:
    """How many cell images each way, per cell vector, can hold a pair within ``cutoff``
    (Å) of atoms wrapped into the ``cell`` [3, 3] (rows: cell vectors): a vector's
    fractional coordinate k is at most its length times |column k of the inverse cell|,
    and wrapped atoms differ by less than 1 in each."""
    reciprocal = np.linalg.norm(np.linalg.inv(cell), axis=0)
    return [int(cutoff * length) + 1 for length in reciprocal]


def all_pairs(positions: torch.Tensor, cells: np.ndarray, cutoff: float, reach: list[int]) -> tuple:
    """The full lists (b, i, j, shift S) of pairs with ``|r_j - r_i + S @ cell_b| < cutoff``
    (Å), as vesin gives them, of B 3D-periodic structures of n atoms each (``positions``
    [B, n, 3], float64, on any device; ``cells`` [B, 3, 3] on the host), from all pairs of
    their atoms and every image up to ``reach`` cells each way (:func:`images_needed`),
    :data:`ALL_PAIRS_LIMIT` compared at a time."""
    grid = np.stack(np.meshgrid(*[np.arange(-r, r + 1) for r in reach], indexing="ij"), -1).reshape(-1, 3)
    device, dtype = positions.device, positions.dtype
    shifts = torch.tensor(grid, device=device)  # [I, 3]; the middle one is (0, 0, 0)
    inverse, images, cell = (
        torch.tensor(a, dtype=dtype, device=device) for a in (np.linalg.inv(cells), grid @ cells, cells)
    )
    fractional = positions @ inverse
    whole = torch.floor(fractional)  # r = wrapped + whole @ cell
    wrapped = (fractional - whole) @ cell
    count, n, image_count = len(positions), positions.shape[1], len(grid)
    itself = torch.arange(n, device=device)
    found = []
    step = max(1, ALL_PAIRS_LIMIT // (n * n * image_count))
    for start in range(0, count, step):
        w = wrapped[start : start + step]
        vectors = (
            w[:, None, :, None] - w[:, :, None, None] + images[start : start + step, None, None]
        )  # [b, i, j, I, 3]
        close = (vectors**2).sum(-1) < cutoff**2
        close[:, itself, itself, image_count // 2] = False
        b, i, j, image = close.nonzero(as_tuple=True)
        found.append((b + start, i, j, image))
    b, i, j, image = (torch.cat(parts) for parts in zip(*found))
    whole = whole.long()
    return b, i, j, shifts[image] + whole[b, i] - whole[b, j]  # the shift between the unwrapped positions


def model_neighbor_lists(model, skin: float) -> list:
    """vesin's calculators of the neighbor lists an exported metatomic ``model`` asks for
    (positions in Å, Verlet ``skin`` in Å); each adds its list to a system with
    ``add_neighbor_list(system)``."""
    from vesin.metatomic import neighbor_lists_for_model

    return neighbor_lists_for_model("angstrom", model, skin=skin)


def _vesin_pairs(positions: torch.Tensor, cell: torch.Tensor, pbc: np.ndarray, cutoff: float) -> tuple:
    """vesin's full pair list (i, j, S) of one structure."""
    from vesin import NeighborList

    try:
        return NeighborList(cutoff=cutoff, full_list=True).compute(
            points=positions, box=cell, periodic=pbc, quantities="ijS", copy=True
        )
    except RuntimeError as error:
        raise NeighborListError(str(error)) from error


def build_pairs(
    positions: torch.Tensor,
    host_cells: np.ndarray,
    pbcs: np.ndarray,
    sizes: list[int],
    cutoff: float,
    capacity: int,
    into: Pairs | None = None,
) -> Pairs:
    """Pairs within ``cutoff`` (Å) of the float64 ``positions`` [N, 3] (on CPU or CUDA) of
    structures of ``sizes`` atoms one after another, their cells [S, 3, 3] and ``pbcs``
    [S, 3] (on the host), with atom indices into the whole batch, padded to ``capacity``; when there are
    more pairs than that, padded to 10% more, in multiples of 1024, so that the next lists
    fit too. The padding pairs are atom 0 to itself with no shift. On a GPU, small
    3D-periodic cells of the same size and reach (like path-integral beads) get their pairs
    from one :func:`all_pairs` (:data:`ALL_PAIRS_LIMIT`); the others from vesin, one by one.
    Where every structure is such a cell and Triton runs, the search is
    :mod:`ase_tcfp32._kernels.pairs`' (a few launches, one wait for the device).

    With ``into`` (an earlier build's pairs for the same atoms, on the pairs' device), the
    pairs are written into its tensors where they fit its capacity (a recorded CUDA graph
    reads them; the offsets in its float type) and it is returned with the new count;
    otherwise the pairs are new tensors, the offsets float64."""
    device, n, starts = positions.device, len(positions), np.cumsum([0, *sizes[:-1]])
    alone, groups, kernels = _searches(sizes, pbcs, host_cells, cutoff, positions.is_cuda, device)
    if kernels is not None:
        size, reach = kernels
        return _searched(positions.view(-1, size, 3), host_cells, cutoff, reach, capacity, into)
    cells, found = torch.from_numpy(host_cells).to(device, torch.float64), []
    for k in alone:
        start, size = starts[k], sizes[k]
        i, j, s = _vesin_pairs(positions[start : start + size], cells[k], pbcs[k], cutoff)
        found.append(
            (
                torch.full((len(i),), k, device=device),
                *(t.to(device, torch.int64) + int(start) for t in (i, j)),
                s.to(device, torch.int64),
            )
        )
    for (size, *reach), members in groups.items():
        atoms = torch.from_numpy(starts[members][:, None] + np.arange(size)).to(device)  # [B, size] batch indices
        b, i, j, s = all_pairs(positions[atoms], host_cells[members], cutoff, reach)
        found.append((torch.tensor(members, device=device)[b], atoms[b, i], atoms[b, j], s))
    structure, i, j, shifts = (torch.cat(parts) for parts in zip(*found))
    order = torch.argsort(i, stable=True)
    structure, i, j, shifts = structure[order], i[order], j[order], shifts[order]
    offsets = (shifts.to(cells.dtype)[:, :, None] * cells[structure]).sum(1)  # S @ cell
    count = len(i)

    # the reverse of (i, j, S) is (j, i, -S): match integer keys
    reach = int(shifts.abs().max()) if count else 0
    width = 2 * reach + 1

    def key(a, b, s):
        code = ((s[:, 0] + reach) * width + s[:, 1] + reach) * width + s[:, 2] + reach
        return (a * n + b) * width**3 + code

    sorted_keys, by_key = torch.sort(key(i, j, shifts))
    wanted = key(j, i, -shifts)
    found = torch.searchsorted(sorted_keys, wanted).clamp_max(max(count - 1, 0))
    if count and not bool((sorted_keys[found] == wanted).all()):
        raise ValueError("the neighbor list is not symmetric: a pair i -> j has no j -> i")
    reverse = by_key[found]

    capacity = _room(count, capacity)
    pad = capacity - count
    per_atom = torch.bincount(i, minlength=n)
    pairs = Pairs(
        centers=torch.cat([i, i.new_zeros(pad)]),
        neighbors=torch.cat([j, j.new_zeros(pad)]),
        shifts=torch.cat([shifts, shifts.new_zeros(pad, 3)]),
        offsets=torch.cat([offsets, offsets.new_zeros(pad, 3)]),
        bins=torch.cat([structure, structure.new_zeros(pad)]) * VIRIAL_BINS
        + torch.arange(capacity, device=device) % VIRIAL_BINS,
        reverse=torch.cat([reverse, torch.arange(count, capacity, device=device)]),
        valid=torch.arange(capacity, device=device) < count,
        first=torch.cat([per_atom.new_zeros(1), torch.cumsum(per_atom, 0)]),
        count=count,
    )
    if into is None or into.valid.numel() != capacity:
        return pairs
    for static, fresh in zip(into[:-1], pairs[:-1]):
        static.copy_(fresh)
    return into._replace(count=count)


def _room(count: int, capacity: int) -> int:
    """The capacity for ``count`` pairs: ``capacity`` where it is set (> 0) and they fit, else 10% more than
    ``count``, in multiples of 1024 (so that the next lists fit too)."""
    return capacity if 0 < capacity and count <= capacity else round_up(int(1.1 * count) + 64, 1024)


def _searches(sizes: list[int], pbcs: np.ndarray, cells: np.ndarray, cutoff: float, small: bool, device) -> tuple:
    """How :func:`build_pairs` searches structures of ``sizes`` atoms in ``cells`` [S, 3, 3]
    (``pbcs`` [S, 3]) for ``cutoff`` (Å): the indices of those vesin searches one by one; the
    others by (n, *reach), where ``small`` (on a GPU), the 3D-periodic cells small enough to
    compare every pair of atoms and images at once (:data:`ALL_PAIRS_LIMIT`; reach: the images
    each way); and (n, reach) where they all are one such group that
    :mod:`ase_tcfp32._kernels.pairs` searches on ``device``, else None."""
    alone, groups = [], {}
    for k, (size, pbc, cell) in enumerate(zip(sizes, pbcs, cells)):
        reach = images_needed(cell, cutoff) if small and pbc.all() and abs(np.linalg.det(cell)) > 1e-6 else None
        if reach is None or size**2 * np.prod([2 * r + 1 for r in reach]) > ALL_PAIRS_LIMIT:
            alone.append(k)
        else:
            groups.setdefault((size, *reach), []).append(k)
    if alone or len(groups) != 1 or not _kernel_searches(device):
        return alone, groups, None
    ((size, *reach),) = groups
    return alone, groups, (size, reach)


def _kernel_searches(device: torch.device) -> bool:
    """Whether :mod:`ase_tcfp32._kernels.pairs` can search on ``device`` (CUDA, where Triton
    builds its launchers)."""
    return device.type == "cuda" and triton_build_problem() is None


def _searched(
    positions: torch.Tensor, host_cells: np.ndarray, cutoff: float, reach: list[int], capacity: int, into
) -> Pairs:
    """:func:`build_pairs` of B periodic structures of n atoms (``positions`` [B, n, 3]) by
    :mod:`ase_tcfp32._kernels.pairs`, images up to ``reach`` cells each way, written into
    ``into`` where they fit."""
    from ._kernels.pairs import count_pairs, geometry, write_pairs

    first, state = count_pairs(positions, geometry(host_cells, positions.device), cutoff, reach)
    count = int(first[-1])  # the one wait for the device
    if into is None or count > into.valid.numel():
        capacity, device, index = _room(count, capacity), positions.device, torch.int64
        into = Pairs(
            *(torch.empty(capacity, dtype=index, device=device) for _ in range(2)),
            torch.empty(capacity, 3, dtype=index, device=device),
            torch.empty(capacity, 3, dtype=torch.float64, device=device),
            *(torch.empty(capacity, dtype=index, device=device) for _ in range(2)),
            torch.empty(capacity, dtype=torch.bool, device=device),
            first,
            count,
        )
    else:
        into.first.copy_(first)
    write_pairs(state, into[:7], VIRIAL_BINS)
    return into._replace(count=count)


def missing_pairs(pairs: Pairs, batch: Structures, cutoff: float) -> int:
    """How many of the pairs within ``cutoff`` (Å) of the structures ``batch``, searched
    afresh (vesin, on the CPU), the candidate ``pairs`` lack: 0 where they are complete."""
    positions = torch.from_numpy(batch.positions)
    fresh = build_pairs(positions, batch.cells, batch.pbcs, batch.sizes, cutoff, 0)

    def keys(found: Pairs) -> set:
        valid = found.valid.cpu()
        columns = (found.centers.cpu()[valid, None], found.neighbors.cpu()[valid, None], found.shifts.cpu()[valid])
        return set(map(tuple, torch.cat(columns, dim=1).tolist()))

    return len(keys(fresh) - keys(pairs))


def segment_sum(values: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """Each atom's sum [N, ...] of the per-pair ``values`` [E, ...] over its pairs ``first[a]
    .. first[a + 1] - 1`` (``first`` [N + 1]; the padding after ``first[N]`` left out), in
    a fixed order, without atomics: :func:`ase_tcfp32._kernels.segments.segment_sum` where
    Triton runs (CUDA tensors where it can build its launchers, or its interpreter; imported
    only there: Triton is optional), else ``torch.segment_reduce``."""
    if INTERPRETED or (values.is_cuda and triton_build_problem() is None):
        from ._kernels.segments import segment_sum as kernel

        return kernel(values, first)
    return torch.segment_reduce(values, "sum", offsets=first, axis=0)


class PairTerms(torch.autograd.Function):
    """``y_k = x[j_k] + sign * x[i_k]`` for atom values x [N, ...] and pairs i -> j sorted
    by center atom, each with its reverse pair (j -> i; the padding pairs, center 0, are
    their own reverse and get no gradient). Atom a's gradient is the sum over its own
    pairs k of ``g[reverse[k]] + sign * g[k]``: a gather and one segment sum instead of two
    scatter-adds of every pair's gradient onto the atoms, whose atomic additions queue on
    each atom's numbers (~250 pairs per atom at 17,280 water atoms with the 0.5 Å skin, and
    all the padding on atom 0)."""

    @staticmethod
    def forward(ctx, values, centers, neighbors, reverse, first, sign: float):
        ctx.save_for_backward(reverse, first)
        ctx.sign = sign
        return values.index_select(0, neighbors) + sign * values.index_select(0, centers)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        reverse, first = ctx.saved_tensors  # first [N + 1]: the padding after first[N] is left out
        per_pair = grad.index_select(0, reverse) + ctx.sign * grad
        return segment_sum(per_pair, first), None, None, None, None, None


def virials(vectors: torch.Tensor, gradients: torch.Tensor, pairs: Pairs, count: int) -> torch.Tensor:
    """Each structure's derivative of a scalar by its strain [count, 3, 3]: the sum over its
    pairs of v ⊗ dE/dv, from the pairs' ``vectors`` [capacity, 3] and the scalar's
    ``gradients`` by them [capacity, 3] (summed in :data:`VIRIAL_BINS` bins per structure)."""
    terms = (vectors.detach()[:, :, None] * gradients[:, None, :]).reshape(-1, 9)
    bins = terms.new_zeros(count * VIRIAL_BINS, 9).index_add_(0, pairs.bins, terms)
    return bins.reshape(count, VIRIAL_BINS, 3, 3).sum(1)


def pair_vectors(positions: torch.Tensor, pairs: Pairs) -> torch.Tensor:
    """The vectors [capacity, 3] (Å) from each pair's center to its neighbor's image, for
    the ``positions`` [N, 3] (zero for the padding); see :class:`PairTerms`."""
    return PairTerms.apply(positions, pairs.centers, pairs.neighbors, pairs.reverse, pairs.first, -1.0) + pairs.offsets


def uploaded(array: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A copy of the host ``array`` on ``device`` in ``dtype``, rounded there: torch's
    ``.to(device, dtype)`` rounds on the host first, host work between two calls while the
    GPU waits (measured: docs/design.md, "Where the GPU waits for the host")."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    there = host.to(device)  # the host array itself when ``device`` is the CPU
    return there.to(dtype, copy=there is host)  # one copy in every case


class Structures(NamedTuple):
    """Structures one after another, as the host holds them."""

    positions: np.ndarray  # [N, 3] Å, all atoms
    cells: np.ndarray  # [S, 3, 3] Å
    pbcs: np.ndarray  # [S, 3] bool
    numbers: np.ndarray  # [N] atomic numbers
    sizes: list[int]  # atoms per structure

    @classmethod
    def of(cls, structures: list[Atoms]) -> Structures:
        return cls(
            np.concatenate([a.positions for a in structures]),
            np.stack([a.cell.array for a in structures]),
            np.stack([a.pbc for a in structures]),
            np.concatenate([a.numbers for a in structures]),
            [len(a) for a in structures],
        )


class VerletList:
    """The pairs within ``cutoff + skin`` (Å) of the last batch of structures, rebuilt when
    the structures' atoms, sizes or periodicity change, a cell changes, or an atom has moved
    more than ``skin / 2`` since the last build.

    :param cutoff: the model's cutoff (Å).
    :param device: where the pairs live (the model's device).
    :param dtype: the model's floating type (the pairs' cell offsets are kept in it).
    """

    def __init__(self, cutoff: float, device: torch.device, dtype: torch.dtype):
        self.cutoff, self.device, self.dtype = cutoff, device, dtype
        self.skin = 0.0
        self.pairs: Pairs | None = None
        self.rebuilds = 0
        self._key: tuple | None = None  # numbers, pbc and sizes of the current system
        self._reference: tuple[np.ndarray, np.ndarray] | None = None  # positions, cells of the last build
        self._search_device = device  # where vesin runs (the CPU after it failed on the GPU)

    @property
    def reference(self) -> np.ndarray:
        """The positions [N, 3] (Å) the pairs were built for (the last build)."""
        return self._reference[0]

    def new_system(self, batch: Structures) -> bool:
        """Whether ``batch`` is another system than the last one (the pairs are dropped then)."""
        key = (batch.numbers.tobytes(), batch.pbcs.tobytes(), tuple(batch.sizes))
        if key == self._key:
            return False
        self._key, self.pairs = key, None
        return True

    def stale(self, batch: Structures, reach: float = 0.5) -> bool:
        """Whether the pairs must be rebuilt for ``batch`` (of the current system): with a
        ``reach`` under 0.5, already when an atom has moved more than that fraction of the
        skin (room for moves that nobody checks until later)."""
        if self.pairs is None:
            return True
        positions, cells = self._reference
        if not np.array_equal(cells, batch.cells):
            return True
        shift = batch.positions - positions
        return np.einsum("ij,ij->i", shift, shift).max() > (reach * self.skin) ** 2  # 3x np.sum(axis=1)

    def rebuilder(self, batch: Structures) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """For positions of ``batch``'s structures to come (the end of an outer step of multiple
        time stepping), a function that rebuilds the current pairs (those of ``batch``) in their
        buffers from the positions [N, 3] (Å, float64, on the device) without waiting for the
        device, and returns the pair count (a tensor on the device) for :meth:`settle`. The host
        launches it while the device is busy, instead of building later while the device idles.
        None where :mod:`ase_tcfp32._kernels.pairs` does not search these structures (on the
        device, all small periodic cells of one size)."""
        cutoff = self.cutoff + self.skin
        small = _kernel_searches(self.device)  # build_pairs': small cells of positions on this device
        kernels = _searches(batch.sizes, batch.pbcs, batch.cells, cutoff, small, self.device)[2]
        if kernels is None or self.pairs is None:
            return None
        from ._kernels.pairs import count_pairs, geometry, write_pairs

        size, reach = kernels
        pairs, cells = self.pairs, geometry(batch.cells, self.device)  # uploaded now, while the device idles

        def rebuild(positions: torch.Tensor) -> torch.Tensor:
            first, state = count_pairs(positions.view(-1, size, 3), cells, cutoff, reach)
            pairs.first.copy_(first)
            write_pairs(state, pairs[:7], VIRIAL_BINS)
            return first[-1]

        return rebuild

    def settle(self, count: int | None, positions: np.ndarray) -> None:
        """After a :meth:`rebuilder`'s rebuild, once the device has been waited for: the pairs are
        those of ``positions`` [N, 3] (Å, on the host, the positions it was given) where their
        ``count`` fits the buffers; else, or with ``count`` None (positions not to be trusted),
        they are dropped (the next use builds them anew)."""
        if count is None or count > self.pairs.valid.numel():
            self.pairs = None
            return
        self.pairs = self.pairs._replace(count=count)
        self._reference = (positions.copy(), self._reference[1])
        self.rebuilds += 1

    def update(self, batch: Structures, in_place: bool) -> bool:
        """Rebuild the pairs for ``batch``; with ``in_place``, into the current buffers where
        the new pairs fit their capacity (a recorded CUDA graph reads them). Returns whether
        they did."""
        positions = torch.from_numpy(batch.positions).to(self._search_device, torch.float64)
        capacity = self.pairs.valid.numel() if self.pairs is not None else 0
        into = self.pairs if in_place else None
        try:
            pairs = build_pairs(
                positions, batch.cells, batch.pbcs, batch.sizes, self.cutoff + self.skin, capacity, into
            )
        except NeighborListError as error:
            if self._search_device.type == "cpu":
                raise
            warnings.warn(
                f"vesin could not build the neighbor list on {self._search_device} ({error}); using the CPU",
                stacklevel=4,
            )
            self._search_device = torch.device("cpu")
            return self.update(batch, in_place)
        reused = into is not None and pairs.valid is into.valid
        if not reused:
            pairs = pairs._replace(offsets=pairs.offsets.to(self.dtype))
            pairs = Pairs(*(t.to(self.device) if isinstance(t, torch.Tensor) else t for t in pairs))
        self.pairs = pairs
        self._reference = (batch.positions.copy(), batch.cells.copy())
        self.rebuilds += 1
        return reused
