"""PET on metatrain's neighbor table with our kernels: its PreLN transformer layers' norms,
SwiGLU and residual additions in the GEMMs' kernels (:mod:`ase_tcfp32._epilogues`), and its
featurizer's message combination in one kernel each way (:func:`ase_tcfp32._fused.combine_messages`).

The lean engine's packed rows (:mod:`ase_tcfp32._packed`) call those epilogues on their
own layout. Wherever PET runs on metatrain's [atoms, J] table instead (the metatomic
engine: models with charge and spin conditioning or long-range modules; the lean engine's
table when rows cannot be packed), metatrain's ``TransformerLayer._forward_pre_ln_impl``
ran, per layer, the edge and node feed-forwards' RMS norms, their SwiGLU activations and
three residual additions as passes of their own over [atoms, J, d] tensors.
:func:`swap_transformer_layers` turns every PreLN ``TransformerLayer`` of a model into a
``FusedTransformerLayer`` (the same module, parameters and state_dict keys; only its class
changes) that computes the same expression in metatrain's order with:

- ``nodes + center_expansion(out)`` as one GEMM with its residual;
- ``x + mlp(norm(x))`` for both feed-forwards through :func:`ase_tcfp32._epilogues.feed_forward`:
  without gradients the norm folded into the input projection, SwiGLU and the residual in
  the kernels' epilogues; with gradients :func:`ase_tcfp32._fused.pre_norm` (one backward
  kernel for the norm and the residual) and the SwiGLU in the first layer's kernel;
- the attention's norm, without gradients, folded into its input projection (a
  ``TCAttentionBlock``, :mod:`ase_tcfp32._attention`, takes the norm; metatrain's block
  gets the normed tokens).

:func:`swap_backends` turns a model's ``PETBackend`` with a feed-forward featurizer into a
``FusedPETBackend`` whose featurizer normalises each message next to its reverse pair's,
``LayerNorm(cat(o, o[reverse]))``, in :func:`ase_tcfp32._fused.combine_messages` (with the
residual ``edges + o``), runs the combination MLP through
:func:`ase_tcfp32._epilogues.combination` (its SiLU and residual in the GEMMs) and the heads
through :func:`ase_tcfp32._epilogues.head` (their SiLUs in the GEMMs; only the heads whose
outputs are read: :class:`HeadFeatures`). Where no kernel
fuses (CPU, ``fp32``, ``torch.compile``, a LayerNorm...) each epilogue runs its steps one by
one, as metatrain writes them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ._epilogues import combination, feed_forward, head, linear
from ._fused import combine_messages, featurizer_layers, pre_norm
from ._swapping import lazy_subclass, swap_class


def _forward_pre_ln_impl(
    self, node_embeddings: torch.Tensor, edge_embeddings: torch.Tensor, cutoff_factors, use_manual_attention: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``TransformerLayer._forward_pre_ln_impl`` on nodes [N, 1, d_node] and edges [N, J, d]:
    the same modules and order, the feed-forwards and the node expansion through the
    epilogues (see the module doc)."""
    centers = self.center_contraction(node_embeddings) if self.expanded_node_features else node_embeddings
    tokens = torch.cat([centers, edge_embeddings], dim=1)
    if getattr(self.attention, "takes_norm", False):  # ours: the norm folded into its input projection
        new_tokens = self.attention(tokens, cutoff_factors, use_manual_attention, self.norm_attention)
    else:
        new_tokens = self.attention(self.norm_attention(tokens), cutoff_factors, use_manual_attention)
    out_nodes, out_edges = torch.split(new_tokens, [1, new_tokens.shape[1] - 1], dim=1)
    if self.expanded_node_features:
        out_nodes = linear(self.center_expansion, out_nodes, residual=node_embeddings)
        residual, x, norm = pre_norm(out_nodes, self.norm_center_features)
        out_nodes = feed_forward(self.center_mlp, x, residual=residual, norm=norm)
    residual, x, norm = pre_norm(edge_embeddings + out_edges, self.norm_mlp)
    return out_nodes, feed_forward(self.mlp, x, residual=residual, norm=norm)


_classes, _layer_getattr = lazy_subclass(
    __name__,
    "FusedTransformerLayer",
    "metatrain.pet.modules.transformer.TransformerLayer",
    _forward_pre_ln_impl=_forward_pre_ln_impl,
    __doc__="metatrain's TransformerLayer with its PreLN feed-forwards and node update in fused GEMMs.",
)
"""metatrain's ``TransformerLayer`` and ``FusedTransformerLayer``, our subclass (:func:`ase_tcfp32._swapping.lazy_subclass`)."""


def swap_transformer_layers(module: torch.nn.Module, enable: bool = True) -> list[str]:
    """Run every PreLN metatrain ``TransformerLayer`` in ``module`` through the fused
    epilogues (``enable=False``: back to metatrain's code); return their names. Idempotent;
    parameters and state_dict keys are unchanged."""
    return swap_class(module, *_classes(), enable, takes=lambda child: child.transformer_type == "PreLN")


def _feedforward_featurization_impl(self, inputs: dict, use_manual_attention: bool) -> tuple:
    """``PETBackend._feedforward_featurization_impl`` with each layer's message combination
    in :func:`combine_messages`: the same modules, in the same order, on the same values
    (the padding slots aside, each its own reverse here); the MLP's SiLU and residual in its
    GEMMs (:func:`ase_tcfp32._epilogues.combination`)."""
    nodes = self.node_embedders[0](inputs["element_indices_nodes"])
    edges = self.edge_embedder(inputs["element_indices_neighbors"])
    conditioning = None
    if self.system_conditioning is not None:
        conditioning = self.system_conditioning(inputs["charge"], inputs["spin_multiplicity"], inputs["system_indices"])
    mask = inputs["padding_mask"]
    slots = torch.arange(mask.numel(), device=mask.device).reshape(mask.shape)
    reverse = torch.where(mask, inputs["reverse_neighbor_index"], slots)  # the padding its own reverse: an involution
    for norm, mlp, gnn_layer, post_node, post_edge in featurizer_layers(self):
        out_nodes, out_edges = gnn_layer(
            nodes,
            edges,
            inputs["element_indices_neighbors"],
            inputs["edge_vectors"],
            mask,
            inputs["edge_distances"],
            inputs["cutoff_factors"],
            use_manual_attention,
        )
        if conditioning is not None:
            out_nodes = out_nodes + conditioning
        # the combination's input and its residual edges + out_edges, from one kernel (not kept
        # alive through the next layer), then its MLP with the SiLU and the residual in the GEMMs
        edges = combination(mlp, *combine_messages(out_edges, reverse, norm, residual=edges))
        nodes, edges = post_node(out_nodes), post_edge(edges)
    return [nodes], [edges]


class HeadFeatures(Mapping):
    """Each head's last-layer features (a list: one tensor per readout layer) by output name,
    computed through :func:`ase_tcfp32._epilogues.head` when first read. metatrain's
    ``PETBackend.predict`` asks for every head's features, then reads those of the outputs
    requested (an energy-only call of PET-MAD: the energy head's, not the direct force and
    stress heads'), so the others are never computed."""

    def __init__(self, heads: torch.nn.ModuleDict, features: list[torch.Tensor]):
        self._heads, self._features, self._computed = heads, features, {}

    def __getitem__(self, name: str) -> list[torch.Tensor]:
        if name not in self._computed:
            self._computed[name] = [head(layers, x) for layers, x in zip(self._heads[name], self._features)]
        return self._computed[name]

    def __iter__(self):
        return iter(self._heads.keys())

    def __len__(self) -> int:
        return len(self._heads)


def _calculate_last_layer_features(self, node_features_list: list, edge_features_list: list) -> tuple:
    """``PETBackend._calculate_last_layer_features``: every head on its layer's node and
    edge features, through :func:`ase_tcfp32._epilogues.head` (its SiLUs in the GEMMs where
    no gradient is asked), each computed when first read (:class:`HeadFeatures`); inside
    ``torch.compile``, metatrain's own code (every head, in plain dicts)."""
    if torch.compiler.is_compiling():
        return super(type(self), self)._calculate_last_layer_features(node_features_list, edge_features_list)
    return HeadFeatures(self.node_heads, node_features_list), HeadFeatures(self.edge_heads, edge_features_list)


_backend_classes, _backend_getattr = lazy_subclass(
    __name__,
    "FusedPETBackend",
    "metatrain.pet.modules.backend.PETBackend",
    _feedforward_featurization_impl=_feedforward_featurization_impl,
    _calculate_last_layer_features=_calculate_last_layer_features,
    __doc__="metatrain's PETBackend with its message combination in :func:`combine_messages` and fused GEMMs, and fused heads.",
)
"""metatrain's ``PETBackend`` and ``FusedPETBackend``, our subclass."""


def __getattr__(attribute: str):
    """Pickling finds either subclass here (:func:`ase_tcfp32._swapping.lazy_subclass`)."""
    return (_backend_getattr if attribute == "FusedPETBackend" else _layer_getattr)(attribute)


def swap_backends(module: torch.nn.Module, enable: bool = True) -> list[str]:
    """Run the message combination of every metatrain ``PETBackend`` with a feed-forward
    featurizer in ``module`` through :func:`combine_messages` (``enable=False``: back to
    metatrain's code); return their names. Idempotent; parameters and state_dict keys are
    unchanged."""
    return swap_class(module, *_backend_classes(), enable, takes=lambda child: child.featurizer_type == "feedforward")
