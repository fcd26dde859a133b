"""The fused SwiGLU swap on CPU: which modules it changes, what it keeps, and the fallbacks."""

import copy
import pickle

import pytest
import torch

from ase_tcfp32.fused import swap_feed_forwards, swiglu

pytest.importorskip("triton")


def test_the_swap_keeps_parameters_and_state_dict_and_survives_copies(tiny_ckpt):
    from ase_tcfp32.fused import FusedFeedForward
    from ase_tcfp32.models import load_pet

    pet = load_pet(tiny_ckpt)
    keys = list(pet.state_dict())
    names = swap_feed_forwards(pet)
    assert names and all(type(pet.get_submodule(n)) is FusedFeedForward for n in names)
    assert any(n.endswith(".mlp") for n in names) and any(n.endswith(".center_mlp") for n in names)
    assert swap_feed_forwards(pet) == names  # idempotent
    assert list(pet.state_dict()) == keys
    for clone in (copy.deepcopy(pet), pickle.loads(pickle.dumps(pet))):
        assert type(clone.get_submodule(names[0])) is FusedFeedForward
    swap_feed_forwards(pet, False)
    assert all(type(pet.get_submodule(n)).__name__ == "FeedForward" for n in names)


def test_a_silu_feed_forward_is_left_alone():
    from metatrain.pet.modules.transformer import FeedForward

    block = FeedForward(8, 16, "SiLU")
    assert swap_feed_forwards(block) == [] and type(block) is FeedForward


def test_calculators_without_tensor_core_attention_keep_metatrains_feed_forward(tiny_ckpt):
    from ase_tcfp32 import TCPETCalculator

    for precision in ("fp32", "tf32x3"):  # on CPU: no kernels of ours
        calc = TCPETCalculator(tiny_ckpt, device="cpu", precision=precision)
        assert all(type(m).__name__ != "FusedFeedForward" for m in calc.pet.modules())


def test_swiglu_on_cpu_tensors_is_metatrains_expression():
    g = torch.Generator().manual_seed(0)
    y = torch.randn(5, 3, 14, generator=g, dtype=torch.float64)
    v, gate = y.chunk(2, dim=-1)
    assert torch.equal(swiglu(y), v * torch.sigmoid(gate))


def test_the_kernels_refuse_what_they_cannot_take_before_launching():
    from ase_tcfp32.kernels import swiglu as kernels

    with pytest.raises(ValueError, match=r"contiguous float32 \[\.\.\., 2F\] tensor expected"):
        kernels.forward(torch.zeros(4, 7))
    with pytest.raises(ValueError, match="float64"):
        kernels.forward(torch.zeros(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.backward(torch.zeros(8, 2), torch.zeros(4, 8).T)
