#!/bin/sh
# Continue training the drafters shipped for the default model from their published weights
# (--init), on the same data recipe as train-default-drafters.sh, under a time budget
# (--max-minutes; a later run continues the checkpoint with --resume). One BLAS thread, so the
# other core stays free. The result replaces the shipped drafter only where it beats it on the
# held-out prompts (mlx-spec bench --prompts benchmarks/heldout_prompts.jsonl).
set -e
WORK=${WORK:-work/drafters}
BIN=${BIN:-.venv/bin}
MINUTES=${MINUTES:-80}
METHODS=${METHODS:-eagle dflash}
SHIP=mlx_spec/shipped/smollm2-135m-instruct
export OPENBLAS_NUM_THREADS=1

$BIN/mlx-spec train data --out "$WORK/data" --max-tokens 160      # resumable
for method in $METHODS; do
  case $method in
  eagle)
    $BIN/mlx-spec train eagle --data "$WORK/data" --feature-cache "$WORK/features" --max-length 512 \
        --save-dtype float16 --save-every 25 --out "$WORK/eagle2" --init "$SHIP/eagle" --steps 400 \
        --batch-size 4 --lr 2e-4 --warmup 10 --ttt-steps 5 --max-minutes "$MINUTES" ;;
  dflash)
    # twice the anchors per sequence of the first run (issue 13's recipe list)
    $BIN/mlx-spec train dflash --data "$WORK/data" --feature-cache "$WORK/features" --max-length 512 \
        --save-dtype float16 --save-every 25 --out "$WORK/dflash2" --init "$SHIP/dflash" --steps 1500 \
        --batch-size 4 --lr 3e-4 --warmup 10 --blocks 32 --max-minutes "$MINUTES" ;;
  esac
done
