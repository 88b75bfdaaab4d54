#!/bin/sh
# Continue training the drafters shipped for the default model from their published weights
# (--init), on the same data recipe as train-default-drafters.sh, under a time budget
# (--max-minutes; a later run continues the checkpoint with --resume). One BLAS thread, so the
# other core stays free. The result replaces the shipped drafter only where it beats it on the
# held-out prompts (mlx-spec bench --prompts benchmarks/heldout_prompts.jsonl).
# DATA_TEMP=0.7 DATA_SEED=1 answers the prompts by sampling instead (the word problems' numbers
# change with the seed): new text for drafters already trained on the greedy answers.
# DATA_MIX=1 trains on both, the greedy and the sampled answers (each prompt twice; the held-out
# split is by prompt, so it stays held out): what the MTP runs of 2026-12-03 trained on. Prompts
# added to `train data` since the committed answers (benchmarks/training/answers/README.md) are
# answered first; the feature cache is found by tokens, so only new sequences are computed.
# LABELS=soft (mtp): the target's distribution at each position instead of the data's token.
# FIXED_TEXT=1: train on installed packages' documentation and code (`train data --fixed-text`,
# text the target did not write) instead of answers; with LABELS=soft, the comparison.
# Every run logs its dev tau at 4 drafts every EVAL_EVERY steps (OUT/train_log.jsonl; copy it to
# benchmarks/training/ and run benchmarks/plot_learning_curves.py).
set -e
WORK=${WORK:-work/drafters}
BIN=${BIN:-.venv/bin}
MINUTES=${MINUTES:-80}
METHODS=${METHODS:-eagle dflash}
DATA_TEMP=${DATA_TEMP:-0}
DATA_SEED=${DATA_SEED:-0}
EVAL_EVERY=${EVAL_EVERY:-50}
MTP_STEPS=${MTP_STEPS:-2000}   # the cosine schedule's length; features are computed for these steps only
EAGLE_STEPS=${EAGLE_STEPS:-400}
SHIP=mlx_spec/shipped/smollm2-135m-instruct
# EAGLE_INIT=DIR EAGLE_OUT=DIR: continue a run's published weights (not shipped yet) with a new
# schedule; the batch order is seeded, so a run that continues with seed 0 finds the features
# of the first run's steps cached.
EAGLE_INIT=${EAGLE_INIT:-$SHIP/eagle}
export OPENBLAS_NUM_THREADS=1
DATA="$WORK/data" FEATURES="$WORK/features"   # shared with train-default-drafters.sh
if [ "$DATA_TEMP" != 0 ] || [ "$DATA_SEED" != 0 ]; then
  DATA="$WORK/data-t$DATA_TEMP-s$DATA_SEED" FEATURES="$WORK/features-t$DATA_TEMP-s$DATA_SEED"
fi

# The answers of 2026-12-04 are committed (ANSWERS, gzipped JSONL): a fresh machine unpacks them
# instead of answering again (~50 CPU-minutes); `train data` then finds every prompt answered.
ANSWERS=benchmarks/training/answers
unpack() {   # unpack NAME DIR
  for split in train heldout; do
    if [ -f "$ANSWERS/$1/$split.jsonl.gz" ] && [ ! -f "$2/$split.jsonl" ]; then
      mkdir -p "$2" && gunzip -c "$ANSWERS/$1/$split.jsonl.gz" > "$2/$split.jsonl"
    fi
  done
}
unpack greedy "$WORK/data"
unpack t0.7-s1 "$WORK/data-t0.7-s1"

LABELS=${LABELS:-hard}
RUN=mtp3-$LABELS
if [ "${FIXED_TEXT:-0}" = 1 ]; then
  DATA="$WORK/text" RUN=mtp3-$LABELS-text
  $BIN/mlx-spec train data --out "$DATA" --fixed-text
elif [ "${DATA_MIX:-0}" = 1 ]; then
  $BIN/mlx-spec train data --out "$WORK/data" --max-tokens 160   # resumable
  $BIN/mlx-spec train data --out "$WORK/data-t0.7-s1" --max-tokens 160 --temp 0.7 --seed 1
  DATA="$WORK/data-mixed"
  mkdir -p "$DATA"
  for split in train heldout; do
    cat "$WORK/data/$split.jsonl" "$WORK/data-t0.7-s1/$split.jsonl" > "$DATA/$split.jsonl"
  done
else
  $BIN/mlx-spec train data --out "$DATA" --max-tokens 160 --temp "$DATA_TEMP" --seed "$DATA_SEED"   # resumable
fi
for method in $METHODS; do
  case $method in
  eagle)
    $BIN/mlx-spec train eagle --data "$DATA" --feature-cache "$FEATURES" --max-length 512 \
        --save-dtype float16 --save-every 25 --out "${EAGLE_OUT:-$WORK/eagle2}" --init "$EAGLE_INIT" --steps "$EAGLE_STEPS" \
        --batch-size 4 --lr 2e-4 --warmup 10 --ttt-steps 5 --max-minutes "$MINUTES" --eval-every "$EVAL_EVERY" ;;
  dflash)
    # twice the anchors per sequence of the first run (issue 13's recipe list)
    $BIN/mlx-spec train dflash --data "$DATA" --feature-cache "$FEATURES" --max-length 512 \
        --save-dtype float16 --save-every 25 --out "$WORK/dflash2" --init "$SHIP/dflash" --steps 1500 \
        --batch-size 4 --lr 3e-4 --warmup 10 --blocks 32 --max-minutes "$MINUTES" --eval-every "$EVAL_EVERY" ;;
  mtp)
    # 2026-12-03: the mixed data, lr 1.5e-4: dev tau 1.83 -> 2.10 in 72 min (benchmarks/training/mtp-fixed-*).
    # Every run's dev tau on the same prompts: the greedy answers' held-out split (chat first, by id).
    $BIN/mlx-spec train mtp --data "$DATA" --feature-cache "$FEATURES-last" \
        --save-dtype float16 --save-every 100 --out "$WORK/$RUN" --eval-data "$WORK/data" --init "$SHIP/mtp" --steps "$MTP_STEPS" --labels "$LABELS" \
        --batch-size 4 --lr 1.5e-4 --warmup 50 --ttt-steps 3 --max-minutes "$MINUTES" --eval-every 100 \
        --eval-prompts 16 ;;
  esac
done
