"""PET's attention on tensor cores, FP32-accurate: :func:`tc_attention` and the block swap.

metatrain's ``AttentionBlock`` projects its input to queries, keys and values, reshapes
them per head, and calls torch's FP32 ``scaled_dot_product_attention`` with the log of
the cutoff weights as an additive mask. :func:`swap_attention_blocks` turns every such
block of a model into a ``TCAttentionBlock`` (the same module, parameters and state_dict
keys; only its class changes) whose forward sends the projection's output straight to
the kernels of :mod:`ase_tcfp32._kernels.attention`, forward and backward (forces and
stress differentiate through it), eagerly through an autograd Function and inside
``torch.compile`` as the custom op ``ase_tcfp32::attention``.

The swap is for the FP32-accurate precisions on CUDA GPUs of compute capability 8.0 and
newer; ``fp32`` and ``tf32`` keep torch's SDPA. A block falls back to metatrain's own
forward for training's double backward (``use_manual_attention``), on CPU tensors, and,
with a :class:`UserWarning` saying why, for sequences longer than the kernels take.
"""

from __future__ import annotations

import warnings

import torch
from torch.autograd.function import once_differentiable
from torch.utils.weak import WeakIdKeyDictionary

from ._epilogues import linear
from ._kernels.context import INTERPRETED
from ._swapping import lazy_subclass, swap_class
from .precision import FP32_ACCURATE, triton_build_problem


def _kernels():
    """:mod:`ase_tcfp32._kernels.attention`, imported on first use (Triton takes a while)."""
    from ._kernels import attention

    return attention


@torch.library.custom_op("ase_tcfp32::attention", mutates_args=())
def _attention_op(qkv: torch.Tensor, mask: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
    """:func:`ase_tcfp32._kernels.attention.forward`, opaque to ``torch.compile``."""
    return _kernels().forward(qkv, mask, heads, scale)


@torch.library.custom_op("ase_tcfp32::attention_backward", mutates_args=())
def _attention_backward_op(
    grad_out: torch.Tensor, qkv: torch.Tensor, mask: torch.Tensor, heads: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ase_tcfp32._kernels.attention.backward`, opaque to ``torch.compile``."""
    return _kernels().backward(grad_out, qkv, mask, heads, scale)


@_attention_op.register_fake
def _(qkv, mask, heads, scale):
    return qkv.new_empty(qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3)


@_attention_backward_op.register_fake
def _(grad_out, qkv, mask, heads, scale):
    return torch.empty_like(qkv), torch.empty_like(mask)


def _setup_context(ctx, inputs, output):
    qkv, mask, ctx.heads, ctx.scale = inputs
    ctx.save_for_backward(qkv, mask)


def _backward(ctx, grad_out):
    qkv, mask = ctx.saved_tensors
    return (*_attention_backward_op(grad_out, qkv, mask, ctx.heads, ctx.scale), None, None)


_attention_op.register_autograd(_backward, setup_context=_setup_context)


class _AttentionFunction(torch.autograd.Function):
    """The eager twin of the custom op (no custom-op dispatch on every call)."""

    @staticmethod
    def forward(ctx, qkv, mask, heads, scale):
        ctx.heads, ctx.scale = heads, scale
        ctx.save_for_backward(qkv, mask)
        return _kernels().forward(qkv, mask, heads, scale)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        qkv, mask = ctx.saved_tensors
        return (*_kernels().backward(grad_out, qkv, mask, ctx.heads, ctx.scale), None, None)


def tc_attention(qkv: torch.Tensor, mask: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
    """Multi-head attention as PET computes it, FP32-accurate on tensor cores.

    ``qkv`` [B, T, 3*H*D]: per token, the queries, keys and values of the ``heads`` heads
    side by side (PET's input projection); ``mask`` [B, T, T]: additive, shared by the
    heads (-inf drops a key). Returns ``softmax(scale * q k^T + mask) v`` as [B, T, H*D]
    (heads side by side: what PET's output projection reads), differentiable with
    respect to ``qkv`` and ``mask``. float32 CUDA tensors (or CPU tensors under Triton's
    interpreter); T at most :func:`ase_tcfp32._kernels.attention.max_tokens` (128 for
    heads of up to 32, 64 for heads of up to 64).
    """
    if qkv.dtype != torch.float32 or mask.dtype != torch.float32:
        raise TypeError(f"tc_attention needs float32 tensors, got {qkv.dtype} and {mask.dtype}")
    qkv, mask = qkv.contiguous(), mask.contiguous()
    if torch.compiler.is_compiling():
        return _attention_op(qkv, mask, heads, scale)
    return _AttentionFunction.apply(qkv, mask, heads, scale)


_BLOCKS = WeakIdKeyDictionary()
"""The packed kernels' blocks, per set of sequences (by their ``counts`` tensor) and head shape."""


def _blocks(sequences, heads: int, head_dim: int):
    """:func:`ase_tcfp32._kernels.attention.packed_blocks` of ``sequences``, fitted once for
    all the attention layers of an evaluation (one launch per step, not one per layer)."""
    fitted = _BLOCKS.setdefault(sequences.counts, {})
    if (heads, head_dim) not in fitted:
        fitted[heads, head_dim] = _kernels().packed_blocks(sequences, heads, head_dim)
    return fitted[heads, head_dim]


class _PackedAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, node_qkv, bias, sequences, heads, scale):
        blocks = _blocks(sequences, heads, qkv.shape[1] // (3 * heads))  # the backward's too
        ctx.sequences, ctx.heads, ctx.scale = sequences, heads, scale
        ctx.save_for_backward(qkv, node_qkv, bias, *blocks)
        return _kernels().forward_packed(qkv, node_qkv, bias, sequences, heads, scale, blocks=blocks)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, node_grad_out):
        qkv, node_qkv, bias, *blocks = ctx.saved_tensors
        grads = _kernels().backward_packed(
            grad_out,
            node_grad_out,
            qkv,
            node_qkv,
            bias,
            ctx.sequences,
            ctx.heads,
            ctx.scale,
            blocks=_kernels().Blocks(*blocks),
        )
        return (*grads, None, None, None)


def tc_attention_packed(
    qkv: torch.Tensor, node_qkv: torch.Tensor, bias: torch.Tensor, sequences, heads: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tc_attention` on sequences stored without padding (PET's packed rows,
    :mod:`ase_tcfp32._packed`): atom a attends over its center token (``node_qkv`` [N,
    3*H*D], row a) and its neighbors' tokens (``qkv`` [E, 3*H*D], the rows ``sequences``
    gives it: :class:`ase_tcfp32._kernels.attention.Sequences`), with an additive ``bias``
    [E] per neighbor token as key (the center token's is 0). Returns the outputs of the
    neighbor tokens [E, H*D] and of the center tokens [N, H*D], differentiable with
    respect to ``qkv``, ``node_qkv`` and ``bias``; float32 CUDA tensors (or CPU tensors
    under Triton's interpreter); other tensors, and sequences longer than the kernels take
    (with a warning), take the same sequences padded, in torch
    (:func:`packed_attention_in_torch`)."""
    if qkv.dtype != torch.float32 or not (qkv.is_cuda or INTERPRETED):
        return packed_attention_in_torch(qkv, node_qkv, bias, sequences, heads, scale)
    head_dim = qkv.shape[1] // (3 * heads)
    if sequences.tokens > _kernels().max_tokens(head_dim):
        warnings.warn(
            f"PET attention runs in torch, slower: the kernels take at most {_kernels().max_tokens(head_dim)} "
            f"tokens with heads of {head_dim}, these sequences have up to {sequences.tokens}",
            stacklevel=2,
        )
        return packed_attention_in_torch(qkv, node_qkv, bias, sequences, heads, scale)
    return _PackedAttentionFunction.apply(
        qkv.contiguous(), node_qkv.contiguous(), bias.contiguous(), sequences, heads, scale
    )


def packed_attention_in_torch(
    qkv: torch.Tensor, node_qkv: torch.Tensor, bias: torch.Tensor, sequences, heads: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tc_attention_packed` in torch, any dtype and device: the sequences gathered
    into [N, T] padded ones (their padding keys at -inf), attended, and scattered back."""
    atoms, tokens, edges = node_qkv.shape[0], sequences.tokens, qkv.shape[0]
    slot = torch.arange(1, tokens, device=qkv.device)
    real = slot <= sequences.counts[:, None]  # [N, T - 1]
    rows = torch.where(real, sequences.first[:, None] + slot - 1, 0)
    x = torch.cat([node_qkv[:, None], qkv[rows]], 1).reshape(atoms, tokens, 3, heads, -1).permute(2, 0, 3, 1, 4)
    keys = torch.cat([bias.new_zeros(atoms, 1), torch.where(real, bias[rows], float("-inf"))], 1)
    y = torch.softmax(x[0] @ x[1].transpose(-1, -2) * scale + keys[:, None, None, :], -1) @ x[2]
    y = y.transpose(1, 2).reshape(atoms, tokens, -1)  # [N, T, C]
    out = y.new_zeros(edges, y.shape[-1]).index_put((rows[real],), y[:, 1:][real])
    return out, y[:, 0]


def _forward(
    self, x: torch.Tensor, cutoff_factors: torch.Tensor, use_manual_attention: bool, norm: torch.nn.Module | None = None
) -> torch.Tensor:
    """``AttentionBlock.forward`` through :func:`tc_attention` (see the module docstring) of
    ``norm(x)`` when a ``norm`` module is given, folded into the input projection's GEMM
    where it can be (:func:`ase_tcfp32._epilogues.linear`)."""
    atoms, tokens, _ = x.shape
    fallback = use_manual_attention or not (x.is_cuda or INTERPRETED) or x.dtype != torch.float32
    if not fallback and tokens > self._max_tokens:
        if not self._warned_fallback:
            why = (
                f"heads of {self.head_dim} are wider than the kernels' 64"
                if self._max_tokens == 0
                else f"the kernels take at most {self._max_tokens} tokens with heads of {self.head_dim}, "
                f"these sequences have {tokens}"
            )
            warnings.warn(f"PET attention runs in torch's FP32 SDPA here: {why}", stacklevel=2)
            self._warned_fallback = True
        fallback = True
    if fallback:
        return super(type(self), self).forward(x if norm is None else norm(x), cutoff_factors, use_manual_attention)
    qkv = linear(self.input_linear, x, norm=norm)
    mask = torch.log(torch.clamp(cutoff_factors, self.epsilon))
    out = tc_attention(qkv, mask, self.num_heads, 1.0 / (self.head_dim**0.5 * self.temperature))
    return self.output_linear(out)


_classes, __getattr__ = lazy_subclass(
    __name__,
    "TCAttentionBlock",
    "metatrain.pet.modules.transformer.AttentionBlock",
    _warned_fallback=False,
    takes_norm=True,  # forward(x, cutoff_factors, use_manual_attention, norm): see _forward
    forward=_forward,
    __doc__="metatrain's AttentionBlock with its attention in :func:`tc_attention`.",
)
"""metatrain's ``AttentionBlock`` and ``TCAttentionBlock``, our subclass (:func:`ase_tcfp32._swapping.lazy_subclass`)."""


def on_tensor_cores(precision: str, device: torch.device | str) -> bool:
    """Whether a calculator in ``precision`` on ``device`` runs PET's attention through
    :func:`tc_attention` (FP32-accurate precisions on CUDA, where Triton can build its
    launchers: :func:`ase_tcfp32.precision.triton_build_problem`) rather than torch's SDPA."""
    return precision in FP32_ACCURATE and torch.device(device).type == "cuda" and triton_build_problem() is None


def swap_attention_blocks(module: torch.nn.Module, enable: bool = True) -> list[str]:
    """Run the attention of every metatrain ``AttentionBlock`` in ``module`` through
    :func:`tc_attention` (``enable=False``: back to torch's SDPA); return their names.
    Idempotent; parameters and state_dict keys are unchanged."""
    names = swap_class(module, *_classes(), enable)
    for name in names if enable else ():
        block = module.get_submodule(name)
        block._max_tokens = _kernels().max_tokens(block.head_dim)
    return names
