#!/usr/bin/env bash
# Rebuild the bundled demo PET from scratch (about 3 hours on 2 CPU cores; mtt uses a GPU when there is one):
#   1. label the data with the CHGNet r2SCAN teacher (needs `pip install chgnet`, kept
#      out of ase-tcfp32's requirements: use a separate environment, TEACHER_PYTHON);
#   2. train with `mtt train` and the options in scripts/demo_model/options.yaml (stage 1),
#      then fine-tune that model with the same options and four overrides (stage 2: a
#      fresh, smaller cosine schedule; 40 epochs, ~5 minutes on an H200, ~35 on 2 CPU cores);
#   3. fine-tune stage 2 once more with the "contacts" family (metal pairs closer than in the
#      other data) added: without it the model pulled Cr-Cr pairs to 1.05 Å in slab
#      relaxations (stage 3: 36 epochs, ~5.5 minutes on an H200);
#   4. save a slim checkpoint into the package and evaluate it against the teacher.
set -euo pipefail
cd "$(dirname "$0")/.."
TEACHER_PYTHON=${TEACHER_PYTHON:-python}
PYTHON=${PYTHON:-.venv/bin/python}
work=build/demo-model
mkdir -p "$work/stage3"
"$TEACHER_PYTHON" scripts/make_dataset.py --out "$work"
(cd "$work" && "$OLDPWD/.venv/bin/mtt" train "$OLDPWD/scripts/demo_model/options.yaml" -o model.pt)
finetune() {  # finetune DIR CHECKPOINT EPOCHS: options.yaml from CHECKPOINT, a fresh cosine schedule from 3e-4
  (cd "$1" && "$OLDPWD/.venv/bin/mtt" train "$OLDPWD/scripts/demo_model/options.yaml" \
    -r architecture.training.finetune.read_from="$2" -r architecture.training.finetune.method=full \
    -r architecture.training.num_epochs="$3" -r architecture.training.learning_rate=0.0003 -o model.pt)
}
"$PYTHON" scripts/demo_model/package.py "$work/model.ckpt" "$work/stage1.ckpt"
finetune "$work" stage1.ckpt 40
"$PYTHON" scripts/demo_model/package.py "$work/model.ckpt" "$work/stage3/stage2.ckpt"
for split in train val test; do cat "$work/$split.xyz" "$work/contacts-$split.xyz" > "$work/stage3/$split.xyz"; done
finetune "$work/stage3" stage2.ckpt 36
"$PYTHON" scripts/demo_model/package.py "$work/stage3/model.ckpt" ase_tcfp32/data/pet-demo-chgnet.ckpt
"$PYTHON" scripts/demo_model/evaluate.py --test "$work/stage3/test.xyz" --out docs/demo_model.json
