#!/usr/bin/env bash
# Trains the built-in demo pair end to end, as recorded in jaxspec/demo/MODEL_CARD.md.
#
#   bash scripts/train_demo_pair.sh DATA WORK
#
# DATA: output of scripts/build_demo_corpus.py (built there if missing).
# WORK: receives run/ (target training state, metrics.json), hf_target/ (Kimi-K2.5
# layout, INT4 experts), target_ck/ (converted), selfgen.npy and selfgen_ft.npy (the
# target's own continuations, two disjoint seeds), hf_draft_base/ (first draft
# stage), hf_draft/ (SpecForge layout, fine-tuned) and pair/ (converted target + draft).
# The draft is trained in two stages: from scratch on self-distilled + corpus text,
# then fine-tuned (--init) at a lower rate on continuations of fresh prompts, which
# the first stage (some 30 passes over its data) has not seen.
# Knobs (environment): SIZE (base), TARGET_STEPS (2500), TARGET_SECONDS (150),
# DRAFT_STEPS (100000), DRAFT_SECONDS (390), FT_SECONDS (170), PROMPTS (32768),
# FT_PROMPTS (65536), GEN_BATCH (4096), AUX_LAYERS ("0 1 2"; "0 1 1" for SIZE=small).
# Each trainer runs min(STEPS, what fits in SECONDS): the step count is measured
# early in the run, fixed, and recorded.
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
gen() {  # out prompts batch seed
  python "$here/make_draft_data.py" --model "$work/target_ck" --tokens "$data/train.npy" --out "$1" \
    --prompts "$2" --batch "$3" --prompt-len 32 --max-new 96 --seed "$4"
}
batch=${GEN_BATCH:-4096}
gen "$work/selfgen.npy" "${PROMPTS:-32768}" "$batch" 0
python -m jaxspec.train_draft --model "$work/target_ck" --data "$work/selfgen.npy" "$data/train.npy" \
  --out "$work/hf_draft_base" --steps "${DRAFT_STEPS:-100000}" --batch 64 --seq-len 256 --ttt-steps 4 \
  --intermediate 2048 --aux-layers ${AUX_LAYERS:-$default_aux} --lr 3e-3 --time-budget "${DRAFT_SECONDS:-390}" --quiet
tail -n 1 "$work/hf_draft_base/train_log.jsonl"
gen "$work/selfgen_ft.npy" "${FT_PROMPTS:-65536}" "$((2 * batch))" 1
python -m jaxspec.train_draft --model "$work/target_ck" --data "$work/selfgen_ft.npy" "$data/train.npy" \
  --out "$work/hf_draft" --init "$work/hf_draft_base" --steps "${DRAFT_STEPS:-100000}" --batch 64 --seq-len 256 \
  --ttt-steps 4 --lr 1e-3 --seed 1 --time-budget "${FT_SECONDS:-170}" --quiet
tail -n 1 "$work/hf_draft/train_log.jsonl"
python -m checkpoints_convert --target "$work/hf_target" --draft "$work/hf_draft" --out "$work/pair"
