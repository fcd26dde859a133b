"""PET on packed rows: each atom's real neighbors only, no neighbor-table padding.

metatrain's PET works on an [atoms, J] table of neighbor slots, J being the largest
neighbor count; every edge GEMM, norm, feed-forward and message combination runs on the
padding slots too. In water at 17,280 atoms only 77% of PET-S's slots are real (counts
24-39 for a table of 41 columns; 81% with PET-M's), so about a quarter of the edge work
is spent on zeros.

Here the edge tensors are [E, d]: the kept pairs, atom by atom (a center atom's
neighbors in consecutive rows, :class:`Packed`), in a buffer of fixed capacity whose
rows past the real ones hold nothing. The center tokens stay in their own [N, d]
tensors: the transformer layers run their per-token modules on both, and only the
attention (:func:`ase_tcfp32._attention.tc_attention_packed`) reads an atom's center
token next to its neighbors' rows. The modules are metatrain's (and the model's swapped
ones: tensor-core Linear layers, fused SwiGLU, message combination, folded compression),
called in metatrain's order; only the layout of their rows differs. The padding slots of
metatrain's table weigh 1e-15 in its attention (the cutoff factors are clamped there)
and none here, so float64 results agree to ~1e-15 relative (``tests/test_packed.py``).

Supported: feed-forward featurizers (every PET-MAD and uPET model) with PreLN or PostLN
transformer layers, and no system conditioning, evaluated with the attention on tensor
cores (:func:`ase_tcfp32._attention.on_tensor_cores`): :func:`unsupported_reason`.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

import torch

from ._attention import tc_attention_packed
from ._epilogues import combination, feed_forward, linear
from ._folded import compress
from ._fused import combine_messages, featurizer_layers, pre_norm
from ._heads import readout
from ._swapping import Recomputed


class Packed(NamedTuple):
    """PET's inputs on packed rows: R edge rows, N atoms."""

    species: torch.Tensor  # [N] int64: the atoms' species indices
    neighbor_species: torch.Tensor  # [R] int64 (0 in the padding rows)
    vectors: torch.Tensor  # [R, 3] Å, center to neighbor (0 in the padding rows)
    distances: torch.Tensor  # [R] Å, their lengths (as metatrain's table: sqrt(|v|² + 1e-15))
    factors: torch.Tensor  # [R] cutoff factors (0 in the padding rows)
    centers: torch.Tensor  # [R] int64: each row's center atom (0 in the padding rows)
    real: torch.Tensor  # [R] bool
    reverse: torch.Tensor  # [R] int64: the row of the reverse pair (a padding row: itself)
    sequences: object  # ase_tcfp32._kernels.attention.Sequences: each atom's rows


def unsupported_reason(pet: torch.nn.Module) -> str | None:
    """Why :func:`energies` cannot evaluate this metatrain PET, or None."""
    backend = pet.backend
    if backend.featurizer_type != "feedforward":
        return f"its featurizer is {backend.featurizer_type!r}, not 'feedforward'"
    if backend.system_conditioning is not None:
        return "it is conditioned on charge and spin"
    types = {layer.transformer_type for gnn in backend.gnn_layers for layer in _inner(gnn).trans.layers}
    if not types <= {"PreLN", "PostLN"}:
        return f"its transformer layers are {sorted(types)}"
    return None


def _inner(layer: torch.nn.Module) -> torch.nn.Module:
    return layer.module if isinstance(layer, Recomputed) else layer


def _attention(
    block: torch.nn.Module,
    edges: torch.Tensor,
    nodes: torch.Tensor,
    factors: torch.Tensor,
    sequences,
    norms=(None, None),
) -> tuple[torch.Tensor, torch.Tensor]:
    """metatrain's ``AttentionBlock`` up to its output projection, on the edge tokens [R, d]
    and center tokens [N, d] (``norms`` applied to each first), the edges' cutoff ``factors``
    [R] weighting them as keys (the center tokens': 1)."""
    scale = 1.0 / (block.head_dim**0.5 * block.temperature)
    bias = torch.log(torch.clamp(factors, block.epsilon))
    qkv, center_qkv = (linear(block.input_linear, tokens, norm=norm) for tokens, norm in zip((edges, nodes), norms))
    return tc_attention_packed(qkv, center_qkv, bias, sequences, block.num_heads, scale)


def _transformer_layer(
    layer: torch.nn.Module, nodes: torch.Tensor, edges: torch.Tensor, factors: torch.Tensor, sequences
) -> tuple[torch.Tensor, torch.Tensor]:
    """metatrain's ``TransformerLayer`` (PreLN or PostLN) on packed rows: its token
    ``cat`` and ``split`` become two tensors that only the attention reads together."""
    center, block = layer.center_contraction(nodes), layer.attention
    if layer.transformer_type == "PreLN":  # x + f(norm(x)): x and norm(x) from one function (_fused.pre_norm)
        residual, tokens, norm = pre_norm(edges, layer.norm_attention)
        out, center_out = _attention(block, tokens, center, factors, sequences, (norm, layer.norm_attention))
        edges = linear(block.output_linear, out, residual=residual)
        new_center = block.output_linear(center_out)
        residual, tokens, norm = pre_norm(edges, layer.norm_mlp)
        edges = feed_forward(layer.mlp, tokens, residual=residual, norm=norm)
    else:
        out, center_out = _attention(block, edges, center, factors, sequences)
        edges = layer.norm_attention(linear(block.output_linear, out, residual=edges))
        new_center = layer.norm_attention(linear(block.output_linear, center_out, residual=center))
        edges = layer.norm_mlp(feed_forward(layer.mlp, edges, residual=edges))
        new_center = layer.norm_mlp(feed_forward(layer.mlp, new_center, residual=new_center))
    if layer.expanded_node_features:
        nodes = linear(layer.center_expansion, new_center, residual=nodes)
        residual, tokens, norm = pre_norm(nodes, layer.norm_center_features)
        return feed_forward(layer.center_mlp, tokens, residual=residual, norm=norm), edges
    return new_center, edges


def _gnn_layer(layer: torch.nn.Module, nodes: torch.Tensor, messages: torch.Tensor, packed: Packed) -> tuple:
    """metatrain's ``CartesianTransformer`` on packed rows, its compression folded
    (:mod:`ase_tcfp32._folded`): the nodes [N, d_node] and edge messages [R, d] out."""
    edges = compress(layer, messages, packed.vectors, packed.distances, packed.neighbor_species)
    for transformer_layer in layer.trans.layers:
        nodes, edges = _transformer_layer(transformer_layer, nodes, edges, packed.factors, packed.sequences)
    return nodes, edges


def features_of(backend: torch.nn.Module, packed: Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """metatrain's feed-forward featurizer on packed rows: the last GNN layer's node
    features [N, d_node] and edge features [R, d_pet] (zero-weighted in the padding rows)."""
    nodes = backend.node_embedders[0](packed.species)
    edges = backend.edge_embedder(packed.neighbor_species)
    for norm, mlp, gnn_layer, post_node, post_edge in featurizer_layers(backend):
        if isinstance(gnn_layer, Recomputed) and torch.is_grad_enabled():
            out_nodes, out_edges = torch.utils.checkpoint.checkpoint(
                _gnn_layer, gnn_layer.module, nodes, edges, packed, use_reentrant=False
            )
        else:
            out_nodes, out_edges = _gnn_layer(_inner(gnn_layer), nodes, edges, packed)
        # the combination's input and its residual edges + out_edges, from one kernel (not kept
        # alive through the next layer: 1.7 GB at 17,280 water atoms with PET-S)
        edges = combination(mlp, *combine_messages(out_edges, packed.reverse, norm, residual=edges))
        nodes, edges = post_node(out_nodes), post_edge(edges)
    return nodes, edges


def predictions(backend: torch.nn.Module, packed: Packed, names: list[str], features: Collection[str] = ()) -> tuple:
    """PET's per-atom predictions [N, C] of the targets ``names`` (before the scaler and
    composition model), read out of one pass of the GNN layers (:func:`ase_tcfp32._heads.readout`),
    and the last-layer features [N, F] of each target (None for those not among ``features``),
    both lists in the order of ``names``."""
    nodes, edges = features_of(backend, packed)
    out = [
        readout(backend, name, nodes, edges, packed.factors, packed.real, packed.centers, name in features)
        for name in names
    ]
    return [prediction for prediction, _ in out], [found for _, found in out]
