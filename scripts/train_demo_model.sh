#!/usr/bin/env bash
# Rebuild the bundled demo PET from scratch (about 6 hours on 2 CPU cores; mtt and the
# pre-training use a GPU when there is one):
#   1. label the data with the CHGNet r2SCAN teacher (needs `pip install chgnet`, kept
#      out of ase-tcfp32's requirements: use a separate environment, TEACHER_PYTHON);
#   2. pre-train the direct force and stress heads with the backbone, from random weights,
#      on the teacher's forces and stress alone (scripts/demo_model/direct_pretraining.py:
#      water first, then every family, then every family with its own loss scale; from
#      random weights all at once they learn nothing in 18,000 steps, docs/demo_model.md);
#   3. stage 1: fine-tune all of it on energy, forces and the direct targets
#      (scripts/demo_model/direct_options.py: the recipe's options.yaml with the teacher's
#      forces and stress also as the direct heads' targets), 120 epochs at 3e-4; stage 2:
#      the same options, a fresh, smaller cosine schedule (40 epochs at 3e-4);
#   4. stage 3: fine-tune stage 2 once more with the "contacts" family (metal pairs closer
#      than in the other data) added: without it the model pulled Cr-Cr pairs to 1.05 Å in
#      slab relaxations (36 epochs);
#   5. stage 4: fine-tune stage 3 with the energy's loss on absolute errors (the metric we
#      report) and the Cantor-alloy and "other" structures repeated four times: metatrain
#      weights every force component alike, and those families hold 21% and 3% of the atoms
#      (36 epochs at 2e-4); stage 5: briefly with the "other" structures repeated eight
#      times and the direct heads fitted to stage 4's own conservative forces and stress
#      instead of the teacher's (direct_options.py --own: what multiple time stepping needs
#      them to match; 8 epochs at 1e-4);
#   6. wrap stage 5 in metatrain's LLPR, as the PET-MAD releases are (scripts/demo_model/llpr.sh:
#      energy uncertainty calibrated against the teacher on the validation set, a 128-member
#      energy ensemble; the PET inside stays bit-identical, which the script checks; ~1 minute);
#   7. save the slim checkpoint into the package, evaluate it against the teacher (its direct
#      heads against its own conservative forces too), and measure its uncertainty on the test
#      set and on out-of-distribution structures (scripts/demo_model/ood_structures.py,
#      labelled by the teacher).
set -euo pipefail
cd "$(dirname "$0")/.."
TEACHER_PYTHON=${TEACHER_PYTHON:-python}
PYTHON=${PYTHON:-.venv/bin/python}
work=build/demo-model
"$TEACHER_PYTHON" scripts/make_dataset.py --out "$work"
pretrain() {  # pretrain NAME [OPTION ...]: direct_pretraining.py, its log and weights as $work/pretraining/NAME.{json,ckpt}
  local name=$1; shift
  mkdir -p "$work/pretraining"
  "$PYTHON" scripts/demo_model/direct_pretraining.py --work "$work" "$@" --out "$work/pretraining/$name.json"
}
pretrain water --families water --lr 1e-3 --steps 10290
pretrain all --start "$work/pretraining/water.ckpt" --lr 3e-4 --steps 8189
pretrain per-family --start "$work/pretraining/all.ckpt" --lr 3e-4 --per-family --anneal 0.3 --steps 41630
finetune() {  # finetune DIR DATA CHECKPOINT EPOCHS LEARNING_RATE [-r OVERRIDE ...]: DATA/{train,val}.xyz with
  # the direct targets (direct_options.py: the teacher's, or with OWN=1 CHECKPOINT's own) into DIR, trained from
  # CHECKPOINT (in DIR) on a fresh cosine schedule. To resume a stage that stopped, pass `mtt train options.yaml
  # --restart outputs/.../model_N.ckpt` the same -r overrides: options.yaml alone holds the recipe's stage-1 values
  local dir=$1 data=$2 checkpoint=$3 epochs=$4 rate=$5; shift 5
  "$PYTHON" scripts/demo_model/direct_options.py "$data" "$dir" ${OWN:+--own "$dir/$checkpoint"}
  (cd "$dir" && "$OLDPWD/.venv/bin/mtt" train options.yaml \
    -r architecture.training.finetune.read_from="$checkpoint" -r architecture.training.finetune.method=full \
    -r architecture.training.num_epochs="$epochs" -r architecture.training.learning_rate="$rate" "$@" -o model.pt)
}
package() {  # package STAGE DIR: STAGE's model.ckpt, slim, as DIR/STAGE.ckpt
  mkdir -p "$2"
  "$PYTHON" scripts/demo_model/package.py "$work/$1/model.ckpt" "$2/$1.ckpt"
}
mkdir -p "$work/stage1"
cp "$work/pretraining/per-family.ckpt" "$work/stage1/pretrained.ckpt"
finetune "$work/stage1" "$work" pretrained.ckpt 120 0.0003
package stage1 "$work/stage2"
finetune "$work/stage2" "$work" stage1.ckpt 40 0.0003
package stage2 "$work/stage3"
mkdir -p "$work/stage3/data"
for split in train val test; do cat "$work/$split.xyz" "$work/contacts-$split.xyz" > "$work/stage3/data/$split.xyz"; done
finetune "$work/stage3" "$work/stage3/data" stage2.ckpt 36 0.0003
reweighted() {  # reweighted STAGE EPOCHS LEARNING_RATE FAMILY=TIMES ...: fine-tune the previous stage on
  # stage 3's data with those families repeated and the energy's loss on absolute errors
  local stage=$1 epochs=$2 rate=$3; shift 3
  local previous=stage$((stage - 1)) dir=$work/stage$stage
  package "$previous" "$dir"
  mkdir -p "$dir/data"
  "$PYTHON" scripts/demo_model/repeat.py "$work/stage3/data/train.xyz" "$dir/data/train.xyz" "$@"
  cp "$work/stage3/data/val.xyz" "$work/stage3/data/test.xyz" "$dir/data/"
  finetune "$dir" "$dir/data" "$previous.ckpt" "$epochs" "$rate" -r architecture.training.loss.energy.type=mae \
    -r architecture.training.loss.energy.gradients.positions.type=mae
}
reweighted 4 36 0.0002 cantor=4 other=4
OWN=1 reweighted 5 8 0.0001 cantor=4 other=8
package stage5 "$work"
PYTHON=$PYTHON scripts/demo_model/llpr.sh "$work" "$work/stage5.ckpt" ase_tcfp32/data/pet-demo-chgnet.ckpt
"$PYTHON" scripts/demo_model/evaluate.py --test "$work/stage5/data/test.xyz" --parts test,relax,nve,direct,mts \
  --merge-into docs/demo_model.json
"$TEACHER_PYTHON" scripts/demo_model/ood_structures.py --out "$work/ood.xyz"
"$PYTHON" scripts/demo_model/evaluate_uncertainty.py --model ase_tcfp32/data/pet-demo-chgnet.ckpt \
  --test tests/data/demo_model/test.xyz --ood "$work/ood.xyz" --merge-into docs/demo_model.json
