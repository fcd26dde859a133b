"""PET on packed rows in pieces, one GNN layer at a time: systems larger than the GPU.

A whole-system evaluation keeps every layer's activations for the backward pass: about
1.6 MB per water atom with PET-S (0.9 MB with ``low_memory=True``), so an H200 holds
~80,000 atoms (~130,000). But a GNN layer of PET is local: atom i's new node features and
its rows' messages depend only on its own node features and rows (its neighbors' messages
from the layer before, its pairs' geometry). Only between layers do rows meet rows of other
atoms: the message combination pairs each row with its reverse row,
``e' = e + o + mlp(norm(cat(o, o[reverse])))``. So the layers run piece by piece (a piece:
consecutive atoms and their rows), and only per-row tensors of the whole system stay in
memory between them:

- forward: each layer's output messages ``o`` [R, d] are written piece by piece, then the
  next layer's input messages from them; every layer's input messages are kept (the
  first layer's, an embedding of the neighbors' species, is recomputed instead);
- backward (:class:`_Pieces`): from the top, the readout and the last combination
  piece by piece, which gives the gradients of the last ``o`` (scattered to the reverse
  rows too) and of the last input messages; then for each layer, top down, its pieces
  run again with gradients (their activations exist for one piece at a time) and return
  the gradients of their input messages, node features and pair geometry; below the top
  layer, that layer's ``o`` is computed again first, without gradients, for its
  combination's backward.

At the peak (the top layer's backward) the system holds its kept rows [R, d] five times
over for three GNN layers (PET-S: d = 256; water keeps ~32 rows per atom: ~160 KB per
atom) plus its candidate pairs; the pieces' own activations are bounded by their size.
The price: every layer runs forward once more, with gradients, in the backward pass, and
each layer below the top one a third time for its outputs (a whole evaluation runs each
layer forward once and backward once); where memory allows (:class:`Pieces`' ``keep``),
those outputs are kept from the forward pass instead (two more per-pair tensors with three
GNN layers). What the forward pass keeps stays until the graph is released, so that the
backward pass can run again (the LLPR's force ensembles differentiate the energy head's
last-layer features once per direction of the ensemble's weights); the peak is the top
layer's backward either way. Results are the whole evaluation's to rounding: the same
modules on the same rows, summed in another order (``tests/test_layerwise.py``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

import numpy as np
import torch

from . import _progress as progress
from ._epilogues import combination
from ._heads import readout
from ._kernels.attention import Sequences
from ._packed import Packed, _gnn_layer, _inner
from ._packed import predictions as _packed_predictions


class Pieces(NamedTuple):
    """When and how to evaluate in pieces: systems of more than ``above`` atoms, in pieces
    of at most ``atoms`` atoms; systems of up to ``keep`` atoms keep each layer's output
    messages for the backward pass (two more per-pair tensors with three GNN layers, and
    two forward passes of layers fewer)."""

    above: int
    atoms: int
    keep: int = 0


class Piece(NamedTuple):
    """Atoms ``start`` .. ``stop - 1`` and their rows ``first`` .. ``last - 1``."""

    start: int
    stop: int
    first: int
    last: int


def pieces(first: np.ndarray, total: int, atoms: int) -> list[Piece]:
    """Consecutive pieces of at most ``atoms`` atoms, for atoms whose rows start at
    ``first`` [N] (host int64) of ``total`` rows in use."""
    n, first = first.shape[0], np.minimum(first, total)
    bounds = list(range(0, n, max(1, atoms))) + [n]
    ends = np.append(first, total)
    return [Piece(a, b, int(ends[a]), int(ends[b])) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _rows(packed: Packed, piece: Piece, vectors, distances, factors) -> Packed:
    """The rows of ``piece`` as a packed system of its own (its atoms numbered from 0),
    with the given geometry of those rows."""
    a, b, r0, r1 = piece
    sequences = packed.sequences
    local = Sequences(
        sequences.first[a:b] - r0,
        sequences.counts[a:b],
        torch.full((), r1 - r0, dtype=torch.long, device=sequences.first.device),
        sequences.tokens,
    )
    return Packed(
        packed.species[a:b],
        packed.neighbor_species[r0:r1],
        vectors,
        distances,
        factors,
        packed.centers[r0:r1] - a,
        packed.real[r0:r1],
        packed.reverse[r0:r1],
        local,
    )


def _each(plan: list[Piece], what: str):
    """The pieces of ``plan``, each named in the progress line of a long evaluation
    (:mod:`ase_tcfp32._progress`) while it is in hand."""
    for number, piece in enumerate(plan, 1):
        with progress.doing(f"{what}, piece {number} of {len(plan)}"):
            yield piece


def _layer(gnn_layer, nodes, edges, packed: Packed, plan: list[Piece], what: str):
    """One GNN layer over every piece, without gradients (``what`` it is for, in words): node
    features [N, d_node] and output messages [R, d] (zero in the rows no piece holds: the
    padding rows)."""
    out_nodes, out = None, torch.zeros_like(edges)
    for piece in _each(plan, what):
        a, b, r0, r1 = piece
        rows = _rows(packed, piece, packed.vectors[r0:r1], packed.distances[r0:r1], packed.factors[r0:r1])
        new_nodes, out[r0:r1] = _gnn_layer(gnn_layer, nodes[a:b], edges[r0:r1], rows)
        if out_nodes is None:
            out_nodes = new_nodes.new_empty(nodes.shape[0], new_nodes.shape[1])
        out_nodes[a:b] = new_nodes
    return out_nodes, out


def _combination(o: torch.Tensor, o_reverse: torch.Tensor, norm, mlp) -> torch.Tensor:
    """What metatrain's message combination adds to a layer's input messages: the output
    messages ``o`` [rows, d] and the combination of each with its reverse row's
    ``o_reverse`` [rows, d]."""
    return combination(mlp, norm(torch.cat([o, o_reverse], dim=-1)), residual=o)


def _combined(edges, out, rows: slice, reverse, norm, mlp) -> torch.Tensor:
    """The next layer's input messages of ``rows``: the input messages ``edges`` [R, d] plus
    :func:`_combination` of the output messages ``out`` [R, d]."""
    return edges[rows] + _combination(out[rows], out[reverse[rows]], norm, mlp)


class _Pieces(torch.autograd.Function):
    """PET's per-atom predictions from pair geometry, evaluated layer by layer in pieces
    (see the module doc); differentiable with respect to the geometry (rows' vectors,
    distances and cutoff factors), through the first target only."""

    @staticmethod
    def forward(ctx, vectors, distances, factors, backend, packed: Packed, names, plan, features, keep):
        packed = packed._replace(vectors=vectors, distances=distances, factors=factors)
        norms, mlps, layers = backend.combination_norms, backend.combination_mlps, backend.gnn_layers
        nodes = backend.node_embedders[0](packed.species)
        edges = backend.edge_embedder(packed.neighbor_species)
        kept = []  # each layer's inputs (nodes, messages; the first layer's recomputed) and, with keep, outputs
        for k, layer in enumerate(layers):
            inputs = (nodes, edges if k else None)
            nodes, out = _layer(_inner(layer), nodes, edges, packed, plan, f"GNN layer {k + 1}, forward")
            kept.append((*inputs, out if keep and k + 1 < len(layers) else None))
            if k + 1 < len(layers):
                following = torch.empty_like(edges)
                for piece in plan:
                    rows = slice(piece.first, piece.last)
                    following[rows] = _combined(edges, out, rows, packed.reverse, norms[k], mlps[k])
                edges = following
        predictions, found = [[] for _ in names], [[] for _ in names]
        for piece in plan:
            rows = slice(piece.first, piece.last)
            top = _combined(edges, out, rows, packed.reverse, norms[-1], mlps[-1])
            local = _rows(packed, piece, None, None, factors[rows])
            atoms = nodes[piece.start : piece.stop]
            for k, name in enumerate(names):
                prediction, piece_features = readout(
                    backend, name, atoms, top, local.factors, local.real, local.centers, name in features
                )
                predictions[k].append(prediction)
                if piece_features is not None:
                    found[k].append(piece_features)
        ctx.backend, ctx.packed, ctx.names, ctx.plan, ctx.features = backend, packed, names, plan, features
        ctx.kept, ctx.top = kept, (nodes, out, edges)  # kept through repeated backward passes (the LLPR's)
        outputs = [torch.cat(p) for p in predictions] + [torch.cat(f) for f in found if f]
        ctx.mark_non_differentiable(*outputs[1 : len(names)], *outputs[len(names) + (names[0] in features) :])
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, grad, *others):
        backend, packed, plan = ctx.backend, ctx.packed, ctx.plan
        norms, mlps, layers = backend.combination_norms, backend.combination_mlps, backend.gnn_layers
        nodes, out, edges = ctx.top
        energy_features = ctx.names[0] in ctx.features  # the first target's (the LLPR's); the others' have none
        grad_features = others[len(ctx.names) - 1] if energy_features else None
        geometry = [torch.zeros_like(t) for t in (packed.vectors, packed.distances, packed.factors)]
        grad_out = torch.zeros_like(out)  # dE/do of the layer in hand
        grad_edges = torch.zeros_like(out)  # dE/d(that layer's input messages)
        grad_nodes = torch.empty_like(nodes)
        with torch.enable_grad():
            for piece in _each(plan, "readout, backward"):  # the readout and the top combination
                a, b, r0, r1 = piece
                reverse = packed.reverse[r0:r1]
                leaves = [
                    t.detach().requires_grad_()
                    for t in (nodes[a:b], out[r0:r1], out[reverse], edges[r0:r1], packed.factors[r0:r1])
                ]
                top_nodes, o, o_reverse, below, factors = leaves
                top = below + _combination(o, o_reverse, norms[-1], mlps[-1])
                local = _rows(packed, piece, None, None, factors)
                found = readout(
                    backend, ctx.names[0], top_nodes, top, local.factors, local.real, local.centers, energy_features
                )
                values, given = zip(*[(v, g[a:b]) for v, g in zip(found, (grad, grad_features)) if g is not None])
                grads = torch.autograd.grad(values, leaves, given, allow_unused=True)
                grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
                grad_nodes[a:b], grad_edges[r0:r1] = grads[0], grads[3]
                grad_out[r0:r1] += grads[1]
                grad_out.index_add_(0, reverse, grads[2])
                geometry[2][r0:r1] += grads[4]
            del out, edges
            for k in reversed(range(len(layers))):
                layer = _inner(layers[k])
                nodes, edges, out = ctx.kept[k]
                if edges is None:
                    edges = backend.edge_embedder(packed.neighbor_species)
                if k + 1 < len(layers):  # this layer's combination, backward: dE/do from dE/d(next messages)
                    if out is None:
                        with torch.no_grad():
                            out = _layer(layer, nodes, edges, packed, plan, f"GNN layer {k + 1}, outputs again")[1]
                    grad_out.zero_()
                    for piece in plan:
                        r0, r1 = piece.first, piece.last
                        reverse = packed.reverse[r0:r1]
                        o, o_reverse = (t.detach().requires_grad_() for t in (out[r0:r1], out[reverse]))
                        combined = _combination(o, o_reverse, norms[k], mlps[k])
                        grads = torch.autograd.grad(combined, [o, o_reverse], grad_edges[r0:r1])
                        grad_out[r0:r1] += grads[0]
                        grad_out.index_add_(0, reverse, grads[1])
                    del out
                grad_below = torch.zeros_like(nodes) if k else None
                for piece in _each(plan, f"GNN layer {k + 1}, backward"):  # the layer again, with gradients
                    a, b, r0, r1 = piece
                    inputs = [packed.vectors[r0:r1], packed.distances[r0:r1], packed.factors[r0:r1]]
                    inputs += [nodes[a:b], edges[r0:r1]] if k else []
                    leaves = [t.detach().requires_grad_() for t in inputs]
                    rows = _rows(packed, piece, *leaves[:3])
                    below = (leaves[3], leaves[4]) if k else (nodes[a:b], edges[r0:r1])
                    new_nodes, o = _gnn_layer(layer, *below, rows)
                    grads = torch.autograd.grad(
                        [new_nodes, o], leaves, [grad_nodes[a:b], grad_out[r0:r1]], allow_unused=True
                    )
                    for total, part in zip(geometry, grads[:3]):
                        if part is not None:
                            total[r0:r1] += part
                    if k:
                        grad_below[a:b] = grads[3]
                        grad_edges[r0:r1] += grads[4]
                grad_nodes = grad_below
        return (*geometry, None, None, None, None, None, None)


def predictions(
    backend: torch.nn.Module, packed: Packed, names: list[str], features: Collection[str], policy: Pieces | None
) -> tuple:
    """:func:`ase_tcfp32._packed.predictions` (PET's per-atom predictions [N, C] of the
    targets ``names``, and the last-layer features [N, F] of those among ``features``, else
    None), evaluated in pieces, one GNN layer at a time, where the ``policy`` says so (see
    the module doc; None: never)."""
    if policy is None or packed.species.shape[0] <= policy.above:
        return _packed_predictions(backend, packed, names, features)
    total = int(packed.sequences.total)
    plan = pieces(packed.sequences.first.cpu().numpy(), total, policy.atoms)
    keep = packed.species.shape[0] <= policy.keep
    outputs = _Pieces.apply(
        packed.vectors, packed.distances, packed.factors, backend, packed, list(names), plan, features, keep
    )
    rest = iter(outputs[len(names) :])
    return list(outputs[: len(names)]), [next(rest) if name in features else None for name in names]
