#!/bin/sh
# Continue training the drafters shipped for the default model from their published weights
# (--init), on the same data recipe as train-default-drafters.sh, under a time budget
# (--max-minutes; a later run continues the checkpoint with --resume). One BLAS thread, so the
# other core stays free. The result replaces the shipped drafter only where it beats it on the
# held-out prompts (mlx-spec bench --prompts benchmarks/heldout_prompts.jsonl).
# DATA_TEMP=0.7 DATA_SEED=1 answers the prompts by sampling instead (the word problems' numbers
# change with the seed): new text for drafters already trained on the greedy answers.
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
SHIP=mlx_spec/shipped/smollm2-135m-instruct
export OPENBLAS_NUM_THREADS=1
DATA="$WORK/data" FEATURES="$WORK/features"   # shared with train-default-drafters.sh
if [ "$DATA_TEMP" != 0 ] || [ "$DATA_SEED" != 0 ]; then
  DATA="$WORK/data-t$DATA_TEMP-s$DATA_SEED" FEATURES="$WORK/features-t$DATA_TEMP-s$DATA_SEED"
fi

$BIN/mlx-spec train data --out "$DATA" --max-tokens 160 --temp "$DATA_TEMP" --seed "$DATA_SEED"   # resumable
for method in $METHODS; do
  case $method in
  eagle)
    $BIN/mlx-spec train eagle --data "$DATA" --feature-cache "$FEATURES" --max-length 512 \
        --save-dtype float16 --save-every 25 --out "$WORK/eagle2" --init "$SHIP/eagle" --steps 400 \
        --batch-size 4 --lr 2e-4 --warmup 10 --ttt-steps 5 --max-minutes "$MINUTES" --eval-every "$EVAL_EVERY" ;;
  dflash)
    # twice the anchors per sequence of the first run (issue 13's recipe list)
    $BIN/mlx-spec train dflash --data "$DATA" --feature-cache "$FEATURES" --max-length 512 \
        --save-dtype float16 --save-every 25 --out "$WORK/dflash2" --init "$SHIP/dflash" --steps 1500 \
        --batch-size 4 --lr 3e-4 --warmup 10 --blocks 32 --max-minutes "$MINUTES" --eval-every "$EVAL_EVERY" ;;
  mtp)
    # the shipped module's loss was still falling at its last step (800)
    $BIN/mlx-spec train mtp --data "$DATA" --feature-cache "$FEATURES-last" --max-length 512 \
        --save-dtype float16 --save-every 25 --out "$WORK/mtp2" --init "$SHIP/mtp" --steps 1000 \
        --batch-size 4 --lr 2e-4 --warmup 10 --ttt-steps 3 --max-minutes "$MINUTES" --eval-every "$EVAL_EVERY" ;;
  esac
done
