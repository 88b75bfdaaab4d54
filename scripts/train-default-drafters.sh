#!/bin/sh
# The recipe of the drafters shipped in mlx_spec/shipped/smollm2-135m-instruct (README,
# "Shipped drafters"): the target answers ~1000 assembled prompts, then one EAGLE-3 layer and a
# 2-layer DFlash drafter train on its answers, sharing one cache of the target's features
# (taps 1, 14, 26 = EAGLE-3's inputs of layers 2, 15, 27); the MTP module and the compact
# Medusa heads share another (tap 29, the last layer). WORK holds everything (~2.5 GB).
# On 2 CPU cores: data ~30 min, features ~12 min, EAGLE ~65 min and DFlash ~65 min run side by
# side (OPENBLAS_NUM_THREADS=1 each), or one after the other with both threads; then MTP
# (~80 min) and Medusa (~50 min) side by side. --max-minutes stops a run, --resume continues it.
set -e
WORK=${WORK:-work/drafters}
BIN=${BIN:-.venv/bin}
SHIP=mlx_spec/shipped/smollm2-135m-instruct
COMMON="--data $WORK/data --feature-cache $WORK/features --max-length 512 --save-dtype float16 --save-every 100"

$BIN/mlx-spec train data --out "$WORK/data" --max-tokens 160
$BIN/mlx-spec train eagle $COMMON --out "$WORK/eagle" --steps 520 --batch-size 4 --lr 5e-4 --warmup 30 \
    --ttt-steps 5
$BIN/mlx-spec train dflash $COMMON --out "$WORK/dflash" --steps 1000 --batch-size 4 --lr 6e-4 --warmup 30 \
    --layers 2 --block-size 16 --target-layers 1,14,26 --blocks 16
$BIN/mlx-spec train mtp $COMMON --out "$WORK/mtp" --steps 800 --batch-size 4 --lr 5e-4 --warmup 20 \
    --ttt-steps 3
$BIN/mlx-spec train medusa $COMMON --out "$WORK/medusa" --steps 875 --batch-size 4 --lr 1e-3 --warmup 20 \
    --heads 4 --layers 1
for method in eagle dflash mtp; do
    mkdir -p "$SHIP/$method"
    cp "$WORK/$method/config.json" "$WORK/$method/model.safetensors" "$SHIP/$method/"
done
mkdir -p "$SHIP/medusa"
cp "$WORK/medusa/config.json" "$WORK/medusa/medusa_lm_head.safetensors" "$SHIP/medusa/"
