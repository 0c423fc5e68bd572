#!/usr/bin/env bash
# Weight updates in flight vs the double buffer alone (issue 48), on the CPU: `offpolicy bench pipeline` (one
# learner, one torch rollout daemon, max_staleness 1) on a 2-layer, 128-wide Llama with a 2048-token vocabulary
# (EOS is one id of 2048, so most responses run to the limit), 4 groups x 4 samples per step, responses of up to
# 1024 tokens (long, as GPT-OSS reasons) and 32 (short); `rollout.double_buffer=true` with
# `rollout.inflight_updates=false`, then `=true`; REPS rounds, each the four runs in turn.
#     bash benchmarks/inflight.sh OUT_DIR            (2 rounds: ~8 min on 2 cores)
# Prints one pipeline table row per run (columns: offpolicy/bench/pipeline.py `table`).
set -u
OUT=$(realpath -m "${1:-runs/bench-inflight}")
REPS=${REPS:-2}
mkdir -p "$OUT"
for rep in $(seq 1 "$REPS"); do
  for tokens in 1024 32; do
    for inflight in false true; do
      dir="$OUT/t$tokens-inflight-$inflight-r$rep"
      offpolicy bench pipeline --out "$dir" --device cpu --layers 2 --hidden 128 --mlp 512 --vocab 2048 \
        --batch 4 --n 4 --new-tokens "$tokens" --steps 10 --warmup 2 --staleness 1 \
        --set rollout.double_buffer=true --set rollout.inflight_updates=$inflight --dir "$OUT/runs" > "$dir.log" 2>&1
      echo "new_tokens $tokens, inflight_updates $inflight, round $rep: $(grep '^| torch' "$dir/pipeline.md")"
    done
  done
done
