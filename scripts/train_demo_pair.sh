#!/usr/bin/env bash
# Trains the built-in demo pair end to end, as recorded in jaxspec/demo/MODEL_CARD.md.
#
#   bash scripts/train_demo_pair.sh DATA WORK
#
# DATA: output of scripts/build_demo_corpus.py (built there if missing).
# WORK: receives run/ (target training state, metrics.json), hf_target/ (Kimi-K2.5
# layout, INT4 experts), target_ck/ (converted), selfgen.npy (the target's own
# continuations), hf_draft/ (SpecForge layout) and pair/ (converted target + draft).
# Knobs (environment): SIZE (base), TARGET_STEPS (2500), TARGET_SECONDS (150),
# DRAFT_STEPS (100000), DRAFT_SECONDS (180), PROMPTS (8192), GEN_BATCH (1024),
# AUX_LAYERS ("0 1 2"; "0 1 1" for SIZE=small). Each trainer runs min(STEPS, what fits in SECONDS): the
# step count is measured early in the run, fixed, and recorded.
set -euo pipefail
data=${1:?usage: train_demo_pair.sh DATA WORK}
work=${2:?usage: train_demo_pair.sh DATA WORK}
size=${SIZE:-base}
if [ "$size" = small ]; then default_aux="0 1 1"; else default_aux="0 1 2"; fi  # 3 and 4 target layers
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$work"
[ -f "$data/train.npy" ] || python "$here/build_demo_corpus.py" --out "$data"

python "$here/train_demo_target.py" --data "$data" --out "$work/run" --size "$size" --steps "${TARGET_STEPS:-2500}" \
  --batch 32 --seq-len 256 --lr 3e-3 --time-budget "${TARGET_SECONDS:-150}" --export "$work/hf_target"
python -m checkpoints_convert --target "$work/hf_target" --out "$work/target_ck"
python "$here/make_draft_data.py" --model "$work/target_ck" --tokens "$data/train.npy" --out "$work/selfgen.npy" \
  --prompts "${PROMPTS:-8192}" --batch "${GEN_BATCH:-1024}" --prompt-len 32 --max-new 224
python -m jaxspec.train_draft --model "$work/target_ck" --data "$work/selfgen.npy" "$data/train.npy" \
  --out "$work/hf_draft" --steps "${DRAFT_STEPS:-100000}" --batch 32 --seq-len 256 --ttt-steps 4 \
  --draft-vocab 2048 --aux-layers ${AUX_LAYERS:-$default_aux} --lr 3e-3 --time-budget "${DRAFT_SECONDS:-180}" --quiet
tail -n 1 "$work/hf_draft/train_log.jsonl"
python -m checkpoints_convert --target "$work/hf_target" --draft "$work/hf_draft" --out "$work/pair"
