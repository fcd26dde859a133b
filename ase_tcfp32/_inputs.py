"""PET's inputs from the pairs it keeps: metatrain's neighbor table, or packed rows.

:class:`Kept` holds, for the candidate pairs of a :class:`ase_tcfp32._neighbors.VerletList`,
which ones lie within PET's adaptive cutoffs and their cutoff factors. From it,
:func:`neighbor_table` builds metatrain's ``batch_data`` ([atoms, J] tables, J the largest
neighbor count plus a margin) and :func:`packed_rows` the same pairs atom after atom with no
padding between atoms (:mod:`ase_tcfp32._packed`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._kernels.attention import Sequences
from ._neighbors import Pairs
from ._packed import Packed


class Kept(NamedTuple):
    """The pairs PET keeps among the candidates (all tensors over the candidate pairs)."""

    vectors: torch.Tensor  # [capacity, 3] Å; the padding pairs moved far past every cutoff
    factors: torch.Tensor  # [capacity] cutoff factors
    keep: torch.Tensor  # [capacity] bool: within the pair's adaptive cutoff
    before: torch.Tensor  # [capacity + 1] int64: the kept pairs before pair k
    counts: torch.Tensor  # [N] int64: each atom's kept pairs


def neighbor_table(kept: Kept, pairs: Pairs, species: torch.Tensor, columns: torch.Tensor) -> tuple:
    """PET's input tensors (its ``batch_data``: [N, J] tables of the ``kept`` pairs) and the
    largest neighbor count (0-d tensor), for atoms of PET ``species`` indices [N], into a
    table of J = ``len(columns)`` columns. Where an atom has more kept pairs than columns,
    the results are wrong and the step must be redone with more."""
    vectors, factors, keep, before, counts = kept
    width, n, capacity = columns.shape[0], species.shape[0], pairs.valid.numel()
    # pair k goes to row centers[k], column = the kept pairs before it in its row
    column = before[:-1] - before[pairs.first[pairs.centers]]
    slot = torch.where(keep & (column < width), pairs.centers * width + column, n * width)
    pair_at = torch.full((n * width + 1,), capacity, dtype=torch.long, device=keep.device)
    pair_at = pair_at.scatter_(0, slot, torch.arange(capacity, device=keep.device))[: n * width]
    mask = pair_at < capacity
    unique_padding = torch.cumsum((~mask).long(), 0) - 1  # distinct indices: a fast index backward
    spread = torch.where(mask, pair_at, unique_padding % capacity)  # padding reads distinct rows
    # The padding slots weigh 1e-15, not 0, in PET's attention (metatrain clamps the cutoff factors
    # before their log), so what they hold matters at that level. Like metatrain's table they hold a
    # real pair (the first kept one; with none, zeros): a zero-length edge can score high enough for
    # the leak to reach ~1e-11 of the energy, where a real edge leaks below float64's rounding.
    first = keep.to(torch.uint8).argmax().reshape(1)  # [1]: no host read, a static shape
    any_kept = keep.any()

    def table(values: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        """[capacity, ...] pair values as [n, width, ...], ``padding`` ([1, ...]: one pair's) or zero in the padding."""
        rows = values.index_select(0, spread).reshape(n, width, *values.shape[1:])
        fill = 0 if padding is None else torch.where(any_kept, padding, torch.zeros_like(padding))
        return torch.where(mask.reshape(n, width, *[1] * (values.dim() - 1)), rows, fill)

    edge_vectors = table(vectors, vectors.index_select(0, first))
    neighbor_species = species[pairs.neighbors]
    # the slot of each pair's reverse (clamped: an overflowing row means the step is redone)
    reverse_slot = slot.index_select(0, pairs.reverse.index_select(0, spread)).clamp_max(n * width - 1)
    batch = {
        "element_indices_nodes": species,
        "element_indices_neighbors": table(neighbor_species, neighbor_species.index_select(0, first)),
        "edge_vectors": edge_vectors,
        "edge_distances": torch.sqrt(torch.sum(edge_vectors**2, dim=2) + 1e-15),
        "padding_mask": mask.reshape(n, width),
        "reverse_neighbor_index": torch.where(mask, reverse_slot, unique_padding).reshape(n, width),
        "cutoff_factors": table(factors),
    }
    return batch, counts.max()


def packed_rows(kept: Kept, pairs: Pairs, species: torch.Tensor, columns: torch.Tensor, rows: int) -> tuple:
    """PET's inputs on packed rows (:class:`ase_tcfp32._packed.Packed`: the ``kept`` pairs,
    atom by atom, in ``rows`` rows), the largest neighbor count and the kept pairs' number
    (0-d tensors), for atoms of PET ``species`` indices [N]; the attention's blocks are tiled
    for sequences of up to ``len(columns) + 1`` tokens. Where there are more kept pairs than
    rows, or more in an atom than columns, the results are wrong and the step must be redone
    with more."""
    vectors, factors, keep, before, counts = kept
    capacity = pairs.valid.numel()
    row = torch.where(keep & (before[:-1] < rows), before[:-1], rows)  # pair k's row (rows: none)
    pair_at = torch.full((rows + 1,), capacity, dtype=torch.long, device=keep.device)
    pair_at = pair_at.scatter_(0, row, torch.arange(capacity, device=keep.device))[:rows]
    real = pair_at < capacity
    spread = torch.where(real, pair_at, torch.arange(rows, device=keep.device) % capacity)  # padding: distinct pairs

    def packed(values: torch.Tensor) -> torch.Tensor:
        """[capacity, ...] pair values as [rows, ...], zero in the padding rows."""
        return torch.where(real.reshape(rows, *[1] * (values.dim() - 1)), values.index_select(0, spread), 0)

    first = before[pairs.first[:-1]]
    total = before[-1]
    own = torch.arange(rows, device=keep.device)  # a padding row is its own reverse
    reverse = torch.where(real, row.index_select(0, pairs.reverse.index_select(0, spread)), own)
    sequences = Sequences(
        first, torch.minimum(counts, (rows - first).clamp_min(0)), total.clamp_max(rows), columns.shape[0] + 1
    )  # no row past the buffer's end is read
    edge_vectors = packed(vectors)
    distances = torch.sqrt(torch.sum(edge_vectors**2, dim=1) + 1e-15)  # as the table's "edge_distances"
    inputs = Packed(
        species,
        packed(species[pairs.neighbors]),
        edge_vectors,
        distances,
        packed(factors),
        packed(pairs.centers),
        real,
        reverse.clamp_max(rows - 1),
        sequences,
    )
    return inputs, counts.max(), total
