#!/usr/bin/env bash
# Wrap the demo PET in metatrain's LLPR, as the PET-MAD releases are (stage 6 of
# scripts/train_demo_model.sh; ~1 minute of one CPU core):
#
#   scripts/demo_model/llpr.sh WORK STAGE5.ckpt OUT.ckpt
#
# WORK holds make_dataset.py's output (train/val/test.xyz, contacts-*.xyz: CHGNet labels);
# STAGE5.ckpt is the energy model (to redo this from the shipped model without stages 1-5:
# `git show 0336e4f:ase_tcfp32/data/pet-demo-chgnet.ckpt > stage5.ckpt`, the last commit
# before the LLPR). llpr.yaml: last-layer covariance on the training structures, one
# calibration factor from the validation structures' energy errors against the teacher,
# a 128-member energy ensemble; no gradient training, so the PET inside is untouched, which
# check_unchanged.py then checks (energies and forces of the shipped test set bit-identical
# to STAGE5's, through metatomic-ase and through ase-tcfp32; the script stops otherwise).
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$1 stage5=$2 out=$3
PYTHON=${PYTHON:-.venv/bin/python}
MTT=${MTT:-$(cd "$(dirname "$PYTHON")" && pwd)/mtt}  # absolute: it runs from $work/llpr
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
root=$PWD
mkdir -p "$work/llpr"
cp "$stage5" "$work/llpr/stage5.ckpt"
for split in train val test; do
  ln -sf "../$split.xyz" "../contacts-$split.xyz" "$work/llpr/"
done
(cd "$work/llpr" && "$MTT" train "$root/scripts/demo_model/llpr.yaml" -o model.pt)
"$PYTHON" scripts/demo_model/package.py "$work/llpr/model.ckpt" "$out"
"$PYTHON" scripts/demo_model/check_unchanged.py "$stage5" "$out" tests/data/demo_model/test.xyz
