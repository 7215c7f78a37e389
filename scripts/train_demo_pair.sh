#!/usr/bin/env bash
# Trains the built-in demo pair end to end, as recorded in jaxspec/demo/MODEL_CARD.md.
#
#   bash scripts/train_demo_pair.sh DATA WORK
#
# DATA: output of scripts/build_demo_corpus.py (built there if missing).
# WORK: receives run/ (target training state, metrics.json), hf_target/ (Kimi-K2.5
# layout, INT4 experts), target_ck/ (converted), selfgen_s*.npy (the target's own
# continuations, one file per seed), hf_draft_1/ .. hf_draft_4/ (SpecForge layout,
# one per draft stage; hf_draft_4 is the shipped draft) and pair/ (converted target +
# the last draft).
# The draft is trained in four stages: from scratch on self-distilled + corpus text,
# then fine-tuned (--init) three times at a lower rate, each time on continuations of
# fresh prompts (new seeds) that no earlier stage has seen: the first stage makes some
# 30 passes over its data and starts to memorise it, fresh text keeps improving it.
# Knobs (environment): SIZE (base), TARGET_STEPS (2500), TARGET_SECONDS (150),
# DRAFT_STEPS (100000), DRAFT_SECONDS (390), FT_SECONDS ("170 270 250", one per
# fine-tune stage), PROMPTS (32768 for stage 1), FT_PROMPTS ("65536 163840 163840":
# prompts per seed, per fine-tune stage), GEN_BATCH (4096), AUX_LAYERS ("0 1 2"; "0 1 1"
# for SIZE=small).
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
gen() {  # seed prompts batch
  python "$here/make_draft_data.py" --model "$work/target_ck" --tokens "$data/train.npy" \
    --out "$work/selfgen_s$1.npy" --prompts "$2" --batch "$3" --prompt-len 32 --max-new 96 --seed "$1"
}
batch=${GEN_BATCH:-4096}
gen 0 "${PROMPTS:-32768}" "$batch"
python -m jaxspec.train_draft --model "$work/target_ck" --data "$work/selfgen_s0.npy" "$data/train.npy" \
  --out "$work/hf_draft_1" --steps "${DRAFT_STEPS:-100000}" --batch 64 --seq-len 256 --ttt-steps 4 \
  --intermediate 2048 --aux-layers ${AUX_LAYERS:-$default_aux} --lr 3e-3 --time-budget "${DRAFT_SECONDS:-390}" --quiet
tail -n 1 "$work/hf_draft_1/train_log.jsonl"

# Fine-tune stages 2-4: stage 2 reads the continuations of seed 1, stage 3 seeds 2 and 3,
# stage 4 seeds 4 and 5; stage k starts from stage k-1 and trains with seed k-1.
read -r -a ft_seconds <<< "${FT_SECONDS:-170 270 250}"
read -r -a ft_prompts <<< "${FT_PROMPTS:-65536 163840 163840}"
for stage in 2 3 4; do
  i=$((stage - 2))
  if [ "$stage" = 2 ]; then seeds="1"; else seeds="$((2 * stage - 4)) $((2 * stage - 3))"; fi
  files=()
  for seed in $seeds; do
    gen "$seed" "${ft_prompts[$i]}" "$((2 * batch))"
    files+=("$work/selfgen_s$seed.npy")
  done
  python -m jaxspec.train_draft --model "$work/target_ck" --data "${files[@]}" "$data/train.npy" \
    --out "$work/hf_draft_$stage" --init "$work/hf_draft_$((stage - 1))" --steps "${DRAFT_STEPS:-100000}" \
    --batch 64 --seq-len 256 --ttt-steps 4 --lr 1e-3 --seed "$((stage - 1))" --time-budget "${ft_seconds[$i]}" --quiet
  tail -n 1 "$work/hf_draft_$stage/train_log.jsonl"
done
python -m checkpoints_convert --target "$work/hf_target" --draft "$work/hf_draft_4" --out "$work/pair"
