"""Save a trained metatrain PET checkpoint without its optimizer state, for shipping.

    python scripts/demo_model/package.py model.ckpt ase_tcfp32/data/pet-demo-chgnet.ckpt
    python scripts/demo_model/package.py stage2.ckpt stage2-zbl.ckpt --add-zbl

``--add-zbl`` turns on metatrain PET's ZBL short-range repulsion (``zbl: true``, an
additive model with no trainable weights) in a model trained without it, so that it can
be fine-tuned with ``-r architecture.model.zbl=true``.
"""

import argparse

import torch
from metatrain.pet import PET
from metatrain.utils.io import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("target")
    parser.add_argument("--add-zbl", action="store_true")
    args = parser.parse_args()
    model = load_model(args.source)
    if args.add_zbl:
        with_zbl = PET(dict(model.hypers, zbl=True), model.dataset_info)
        missing = with_zbl.load_state_dict(model.state_dict(), strict=False).missing_keys
        assert all(key.startswith("additive_models.1.") for key in missing), missing  # ZBL's fixed tables
        model = with_zbl
    checkpoint = model.get_checkpoint()
    checkpoint["model_state_dict"] = checkpoint["best_model_state_dict"] = model.state_dict()
    torch.save(checkpoint, args.target)
    print(f"{args.target}: {sum(p.numel() for p in model.parameters())} parameters, zbl={model.hypers['zbl']}")


if __name__ == "__main__":
    main()
