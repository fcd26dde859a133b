"""PET's edge-token compression with the edge embeddings folded into its weights.

Each GNN layer of metatrain's PET (``CartesianTransformer``) starts by embedding every
neighbor slot: ``e = edge_embedder([v, |v|])`` (a Linear from the edge vector and its
length, 4 -> d), ``n = neighbor_embedder(species)`` (an Embedding; not in the first
layer), then compresses ``[e, n, m]`` with the slot's input message ``m``:
``compress = Linear(3d -> d), SiLU, Linear(d -> d)``. The first product has K = 3d, but
two of its three column blocks act on things the layer knows in advance:

    W [e, n, m] + b = W_m m + (W_e A) [v, |v|] + (W_n E[species] + W_e a + b)

with ``A``, ``a`` the edge embedder's weight and bias and ``E`` the embedding table. So
the layer runs one tensor-core GEMM of K = d on the messages, a K = 4 FP32 product on
the geometry and a gather from a per-species table, and never builds the [slots, 3d]
concatenation: at 17,280 water atoms with PET-S, 2.1 GB per layer written and read, and
two thirds of the largest GEMM's products. The folded weights ``W_e A``, ``W_n E^T +
W_e a + b`` are computed once in float64 and rounded to FP32 (one rounding of the exact
maps, where the unfolded layer rounds its embeddings and sums): results agree with
metatrain's to FP32 rounding, and forces differentiate the folded energy exactly.

:func:`swap_cartesian_transformers` gives a model's ``CartesianTransformer`` modules the
class ``FoldedCartesianTransformer`` (parameters and state_dict keys unchanged). The
calculator swaps them where PET's attention runs on tensor cores
(:func:`ase_tcfp32._attention.on_tensor_cores`). metatrain's unfolded forward runs when
the model's parameters require gradients (training), under training's double backward,
and inside ``torch.compile`` (which fuses the concatenation into its own kernels).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ._epilogues import pair
from ._kernels.epilogue import Embedding
from ._swapping import lazy_subclass, swap_class
from .layers import TCLinear


class Folded(NamedTuple):
    """The folded compression of one layer, for one device and one state of its weights."""

    messages: nn.Module  # d -> d, no bias: the compression's columns that act on the messages
    geometry: torch.Tensor  # [d, 4]: W_e A
    species: torch.Tensor  # [types, d]: W_n E^T + W_e a + b (first layer: [1, d], W_e a + b)
    key: tuple  # what they were made from


def _key(self) -> tuple:
    first = self.compress[0]
    parameters = [first.weight, first.bias, self.edge_embedder.weight, self.edge_embedder.bias]
    parameters += [] if self.is_first else [self.neighbor_embedder.weight]
    state = [(p.data_ptr(), p._version) for p in parameters]
    return (first.weight.device, getattr(first, "precision", "fp32"), getattr(first, "emulate", None), *state)


def folded(self) -> Folded:
    """The layer's :class:`Folded` compression (made on first use and when the weights,
    their device or the compression's precision change)."""
    key = _key(self)
    fold = self.__dict__.get("_folded")
    if fold is not None and fold.key == key:
        return fold
    first, d = self.compress[0], self.compress[0].out_features
    device, dtype = first.weight.device, first.weight.dtype
    with torch.no_grad():
        w, a = first.weight.double(), self.edge_embedder.weight.double()
        bias = w[:, :d] @ self.edge_embedder.bias.double() + first.bias.double()
        species = bias[None] if self.is_first else self.neighbor_embedder.weight.double() @ w[:, d : 2 * d].T + bias
        if isinstance(first, TCLinear):
            messages = TCLinear(
                d,
                d,
                bias=False,
                device=device,
                dtype=dtype,
                precision=first.precision,
                emulate=first.emulate,
                check_accuracy=first.check_accuracy,
            )
            messages.name = f"{first.name} (input messages)"
        else:
            messages = nn.Linear(d, d, bias=False, device=device, dtype=dtype)
        messages.weight.copy_(first.weight[:, -d:])
        messages.requires_grad_(False)
        fold = Folded(messages, (w[:, :d] @ a).to(dtype), species.to(dtype).contiguous(), key)
    object.__setattr__(self, "_folded", fold)  # not a submodule: the state_dict stays metatrain's
    return fold


def compress(
    self, messages: torch.Tensor, vectors: torch.Tensor, distances: torch.Tensor, species: torch.Tensor
) -> torch.Tensor:
    """The layer's edge tokens [..., d] (its ``compress`` applied to ``[edge_embedder([v,
    |v|]), neighbor_embedder(species), m]``) through its :func:`folded` weights, for the
    input ``messages`` [..., d], edge ``vectors`` [..., 3] (Å), their ``distances`` [...]
    and the neighbors' ``species`` indices [...], in any layout of the slots (metatrain's
    [atoms, J] table or packed rows)."""
    fold = folded(self)
    geometry = torch.cat([vectors, distances[..., None]], dim=-1).to(vectors.dtype).reshape(-1, 4)
    index = torch.zeros_like(species) if self.is_first else species  # the first layer's table: one row
    known = Embedding(fold.species, index.reshape(-1), geometry, fold.geometry)
    return pair(fold.messages, self.compress[2], messages, "silu", inner=known)  # compress[1] is SiLU


def _forward(
    self,
    input_node_embeddings: torch.Tensor,
    input_messages: torch.Tensor,
    element_indices_neighbors: torch.Tensor,
    edge_vectors: torch.Tensor,
    padding_mask: torch.Tensor,
    edge_distances: torch.Tensor,
    cutoff_factors: torch.Tensor,
    use_manual_attention: bool,
) -> tuple:
    """``CartesianTransformer.forward`` with the folded compression (see the module doc)."""
    if use_manual_attention or self.compress[0].weight.requires_grad or torch.compiler.is_compiling():
        return super(type(self), self).forward(
            input_node_embeddings,
            input_messages,
            element_indices_neighbors,
            edge_vectors,
            padding_mask,
            edge_distances,
            cutoff_factors,
            use_manual_attention,
        )
    edge_tokens = compress(self, input_messages, edge_vectors, edge_distances, element_indices_neighbors)

    # from here on, metatrain's CartesianTransformer.forward
    atoms = padding_mask.shape[0]
    total_padding_mask = torch.cat(
        [torch.ones(atoms, 1, dtype=torch.bool, device=padding_mask.device), padding_mask], dim=1
    )
    cutoff_factors = torch.cat(
        [torch.ones(atoms, 1, dtype=cutoff_factors.dtype, device=padding_mask.device), cutoff_factors], dim=1
    )
    cutoff_factors[~total_padding_mask] = 0.0
    cutoff_factors = cutoff_factors[:, None, :]
    cutoff_factors = cutoff_factors.repeat(1, cutoff_factors.shape[2], 1)
    initial_num_tokens, max_num_tokens = edge_vectors.shape[1], input_messages.shape[1]
    output_node_embeddings, output_edge_embeddings = self.trans(
        input_node_embeddings[:, None, :],
        edge_tokens[:, :max_num_tokens, :],
        cutoff_factors=cutoff_factors[:, : (max_num_tokens + 1), : (max_num_tokens + 1)],
        use_manual_attention=use_manual_attention,
    )
    if max_num_tokens < initial_num_tokens:
        padding = torch.zeros(
            output_edge_embeddings.shape[0],
            initial_num_tokens - max_num_tokens,
            output_edge_embeddings.shape[2],
            device=output_edge_embeddings.device,
        )
        output_edge_embeddings = torch.cat([output_edge_embeddings, padding], dim=1)
    return output_node_embeddings.squeeze(1), output_edge_embeddings


_classes, __getattr__ = lazy_subclass(
    __name__,
    "FoldedCartesianTransformer",
    "metatrain.pet.modules.transformer.CartesianTransformer",
    forward=_forward,
    __doc__="metatrain's CartesianTransformer with its edge embeddings folded into the compression's weights.",
)
"""metatrain's ``CartesianTransformer`` and ``FoldedCartesianTransformer``, our subclass."""


def swap_cartesian_transformers(module: torch.nn.Module, enable: bool = True) -> list[str]:
    """Fold the edge embeddings of every metatrain ``CartesianTransformer`` in ``module``
    into its compression (``enable=False``: back to metatrain's code); return their names.
    Idempotent; parameters and state_dict keys are unchanged."""
    return swap_class(module, *_classes(), enable)
