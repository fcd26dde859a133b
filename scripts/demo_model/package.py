"""Save a trained metatrain checkpoint without its optimizer state, for shipping.

    python scripts/demo_model/package.py model.ckpt ase_tcfp32/data/pet-demo-chgnet.ckpt

A PET checkpoint keeps its (last) weights as both ``model_state_dict`` and
``best_model_state_dict`` (one copy on disk). An LLPR checkpoint (the PET it wraps, the
covariances, calibration factors and ensemble weights) is saved as metatrain's
``get_checkpoint`` gives it, which already holds no optimizer state.
"""

import sys

import torch
from metatrain.utils.io import load_model


def main(source: str, target: str) -> None:
    model = load_model(source)
    checkpoint = model.get_checkpoint()
    if checkpoint["architecture_name"] != "llpr":
        checkpoint["model_state_dict"] = checkpoint["best_model_state_dict"] = model.state_dict()
    torch.save(checkpoint, target)
    print(f"{target}: {sum(p.numel() for p in model.parameters())} parameters")


if __name__ == "__main__":
    main(*sys.argv[1:3])
