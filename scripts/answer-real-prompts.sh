#!/bin/sh
# Answer the real prompts (benchmarks/training/real/prompts.jsonl.gz) with the default model,
# greedy, --max-tokens 160 as the committed answers of the assembled prompts, into OUT, in
# chunks of CHUNK minutes up to TOTAL minutes (`train data --max-minutes`; resumable: a later
# run, or a later session, answers only what is not there). One BLAS thread: the other core
# stays free. After each chunk the answers so far are gzipped into SNAPSHOT/{train,heldout}.jsonl.gz
# (written to a temporary file, then moved: a reader never sees half a file); nothing is
# committed here. A fresh machine first unpacks SNAPSHOT into OUT, if OUT has no answers yet.
# Run in the background:  nohup scripts/answer-real-prompts.sh > /tmp/answer-real.log 2>&1 &
set -e
BIN=${BIN:-.venv/bin}
OUT=${OUT:-work/drafters/real-greedy}
SNAPSHOT=${SNAPSHOT:-benchmarks/training/answers/real-greedy}
PROMPTS=${PROMPTS:-benchmarks/training/real/prompts.jsonl.gz}
CHUNK=${CHUNK:-50}
TOTAL=${TOTAL:-300}
export OPENBLAS_NUM_THREADS=1

mkdir -p "$OUT" "$SNAPSHOT"
for split in train heldout; do
  if [ -f "$SNAPSHOT/$split.jsonl.gz" ] && [ ! -s "$OUT/$split.jsonl" ]; then
    gunzip -c "$SNAPSHOT/$split.jsonl.gz" > "$OUT/$split.jsonl"
  fi
done

snapshot() {
  for split in train heldout; do
    if [ -f "$OUT/$split.jsonl" ]; then
      gzip -n -c "$OUT/$split.jsonl" > "$SNAPSHOT/.$split.jsonl.gz.tmp"
      mv "$SNAPSHOT/.$split.jsonl.gz.tmp" "$SNAPSHOT/$split.jsonl.gz"
    fi
  done
  echo "$(date -u +%FT%TZ) snapshot: $(cat "$OUT"/*.jsonl | wc -l) answers -> $SNAPSHOT"
}

spent=0
while [ "$spent" -lt "$TOTAL" ]; do
  minutes=$CHUNK
  [ $((TOTAL - spent)) -lt "$minutes" ] && minutes=$((TOTAL - spent))
  echo "$(date -u +%FT%TZ) chunk of $minutes minutes ($spent of $TOTAL spent)"
  log=$(mktemp)
  $BIN/mlx-spec train data --out "$OUT" --prompts-file "$PROMPTS" --max-tokens 160 \
      --max-minutes "$minutes" 2>&1 | tr '\r' '\n' | grep -v '^answering .*%' | tee "$log" || true
  snapshot
  spent=$((spent + minutes))
  if ! grep -q "stopped after --max-minutes" "$log"; then   # every prompt answered (or an error)
    rm -f "$log"
    break
  fi
  rm -f "$log"
done
echo "$(date -u +%FT%TZ) done"
