import shutil

import pytest
import torch
from metatrain.pet import PET

from ase_tcfp32 import ModelDownloadError, load_pet
from ase_tcfp32.models import cached_checkpoints, known_models, resolve_checkpoint


@pytest.mark.parametrize("name", ["pet-v16", "pet-v8", "pet-v3", "llpr-v4"])
def test_shipped_checkpoints_load_as_frozen_pet_in_eval_mode(shipped, name):
    pet = load_pet(shipped(name))
    assert isinstance(pet, PET)
    assert not pet.training
    assert all(not p.requires_grad for p in pet.parameters())
    assert list(pet.output_shapes) == ["energy"]


def test_llpr_wrapper_is_unwrapped(shipped):
    from metatrain.utils.io import load_model

    wrapped = load_model(shipped("llpr-v4"))
    assert not isinstance(wrapped, PET)
    assert load_pet(wrapped) is wrapped.model


def test_the_energy_and_direct_heads_are_kept_and_others_dropped(tiny_ckpt):
    from metatrain.utils.io import load_model

    raw = load_model(tiny_ckpt)
    kept = {"energy", "non_conservative_force", "non_conservative_stress"}
    assert set(raw.output_shapes) == kept
    pet = load_pet(raw)
    assert set(pet.output_shapes) == set(pet.backend.node_heads) == set(pet.backend.edge_heads) == kept
    pet.remove_output("non_conservative_stress")  # a model without it loads too
    assert set(load_pet(pet).output_shapes) == kept - {"non_conservative_stress"}


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="unknown model 'pet-mud-s'.*pet-mad-s"):
        resolve_checkpoint("pet-mud-s")


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nothing-here.ckpt"
    with pytest.raises(FileNotFoundError, match="nothing-here.ckpt"):
        load_pet(missing)


def test_corrupt_file_names_the_path(tmp_path):
    bad = tmp_path / "corrupt.ckpt"
    bad.write_bytes(b"this is not a checkpoint")
    with pytest.raises(ValueError, match="corrupt.ckpt"):
        load_pet(bad)


def test_offline_name_says_how_to_pass_a_local_file(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache
    with pytest.raises(ModelDownloadError, match="Pass a local checkpoint.*pet-demo-chgnet"):
        load_pet("pet-mad-s")


def test_offline_name_uses_a_cached_download(monkeypatch, tmp_path, tiny_ckpt):
    """A file in the Hugging Face cache layout is found by name without network."""
    snapshot = tmp_path / "models--lab-cosmo--upet" / "snapshots" / ("0" * 40) / "models"
    snapshot.mkdir(parents=True)
    (tmp_path / "models--lab-cosmo--upet" / "refs").mkdir()
    (tmp_path / "models--lab-cosmo--upet" / "refs" / "main").write_text("0" * 40)
    (tmp_path / "models--lab-cosmo--upet" / "blobs").mkdir()
    shutil.copy(tiny_ckpt, snapshot / "pet-mad-s-v1.6.0.ckpt")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    assert [v for v, _ in cached_checkpoints()["pet-mad-s"]] == ["1.6.0"]
    with pytest.warns(UserWarning, match="using the cached pet-mad-s v1.6.0"):
        pet = load_pet("pet-mad-s")
    assert isinstance(pet, PET)


def test_known_models_match_upet():
    from upet._version import UPET_AVAILABLE_MODELS

    assert set(known_models()) == {"pet-demo-chgnet", *UPET_AVAILABLE_MODELS}
    assert "pet-mad-s" in known_models()


def test_non_pet_module_is_rejected():
    with pytest.raises(TypeError, match="expected a metatrain PET"):
        load_pet(torch.nn.Linear(2, 2))
