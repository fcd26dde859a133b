"""The attention swap on CPU: which calculators use it, what it changes in a model and what not."""

import copy
import pickle

import pytest
import torch

from ase_tcfp32._attention import on_tensor_cores, swap_attention_blocks

pytest.importorskip("triton")


def test_only_fp32_accurate_precisions_on_cuda_use_tensor_core_attention():
    assert (
        on_tensor_cores("fp16x3", "cuda") and on_tensor_cores("tf32x3", "cuda:1") and on_tensor_cores("bf16x9", "cuda")
    )
    assert not on_tensor_cores("fp32", "cuda") and not on_tensor_cores("tf32", "cuda")
    assert not on_tensor_cores("tf32x3", "cpu")


def test_the_swap_keeps_parameters_and_state_dict_and_survives_copies(tiny_ckpt):
    from ase_tcfp32._attention import TCAttentionBlock
    from ase_tcfp32.models import load_pet

    pet = load_pet(tiny_ckpt)
    keys = list(pet.state_dict())
    names = swap_attention_blocks(pet)
    assert names and all(type(pet.get_submodule(n)) is TCAttentionBlock for n in names)
    assert swap_attention_blocks(pet) == names  # idempotent
    assert list(pet.state_dict()) == keys
    for clone in (copy.deepcopy(pet), pickle.loads(pickle.dumps(pet))):
        assert type(clone.get_submodule(names[0])) is TCAttentionBlock
    swap_attention_blocks(pet, False)
    assert all(type(pet.get_submodule(n)).__name__ == "AttentionBlock" for n in names)


def test_a_calculator_on_cpu_keeps_torch_sdpa(tiny_ckpt):
    from ase_tcfp32 import TCPETCalculator

    calc = TCPETCalculator(tiny_ckpt, device="cpu", precision="fp32")
    assert calc.attention == "torch SDPA"
    assert all(type(m).__name__ != "TCAttentionBlock" for m in calc.pet.modules())
    assert "attention" in calc._repr_html_()


def test_tc_attention_refuses_other_dtypes():
    from ase_tcfp32._attention import tc_attention

    with pytest.raises(TypeError, match="float32"):
        tc_attention(torch.zeros(2, 3, 48, dtype=torch.float64), torch.zeros(2, 3, 3, dtype=torch.float64), 2, 1.0)


def test_the_kernels_refuse_sequences_longer_than_they_take_before_launching():
    from ase_tcfp32._kernels import attention

    assert attention.max_tokens(32) == 128 and attention.max_tokens(48) == 64 and attention.max_tokens(80) == 0
    with pytest.raises(ValueError, match="at most 64 tokens with heads of 48, not 65"):
        attention.forward(torch.zeros(2, 65, 3 * 2 * 48), torch.zeros(2, 65, 65), 2, 1.0)
    with pytest.raises(ValueError, match=r"qkv \[B, T, 3\*H\*D\] and mask \[B, T, T\] expected"):
        attention.backward(torch.zeros(2, 5, 64), torch.zeros(2, 5, 96), torch.zeros(2, 5, 4), 2, 1.0)
