"""Save a trained metatrain PET checkpoint without its optimizer state, for shipping.

python scripts/demo_model/package.py model.ckpt ase_tcfp32/data/pet-demo-chgnet.ckpt
"""

import sys

import torch
from metatrain.utils.io import load_model


def main(source: str, target: str) -> None:
    model = load_model(source)
    checkpoint = model.get_checkpoint()
    checkpoint["model_state_dict"] = checkpoint["best_model_state_dict"] = model.state_dict()
    torch.save(checkpoint, target)
    print(f"{target}: {sum(p.numel() for p in model.parameters())} parameters")


if __name__ == "__main__":
    main(*sys.argv[1:3])
