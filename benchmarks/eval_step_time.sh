#!/usr/bin/env bash
# Learner step time with and without the eval daemon (docs/eval.md): the quickstart for 150 steps, twice
# each, alternating; the eval daemon every 10 versions on 64 held-out prompts x 16 samples. From the repo
# root, in the venv:   bash benchmarks/eval_step_time.sh [OUT_DIR]
set -euo pipefail
export OUT=$(realpath -m "${1:-runs/eval-step-time}") OMP_NUM_THREADS=1
mkdir -p "$OUT"
for rep in 1 2; do
  for mode in off on; do
    args=(configs/quickstart.yaml run.dir="$OUT/$mode$rep" weights.root=/dev/shm/eval-step-time metrics.port=0
          learner.total_steps=150)
    [[ $mode == on ]] && args+=(eval.every_versions=10 "eval.data.synthetic={task: copy, length: 4, num_prompts: 64, seed: 1}"
                                eval.n_samples=16 "eval.k=[1,4,16]")
    offpolicy run "${args[@]}" > "$OUT/$mode$rep.out" 2>&1
  done
done
python3 - <<'PY'
import json, os, statistics
out = os.environ["OUT"]
for mode in ("off", "on"):
    for rep in (1, 2):
        d = f"{out}/{mode}{rep}/quickstart"
        rows = [json.loads(line) for line in open(f"{d}/metrics.jsonl")][5:]
        wall = json.load(open(f"{d}/summary.json"))["wall_seconds"]
        evals = sum(1 for _ in open(f"{d}/eval.jsonl")) if mode == "on" else 0
        mean = lambda key: statistics.mean(r[key] for r in rows)
        print(f"eval {mode} run {rep}: step mean {mean('total_seconds'):.3f} median "
              f"{statistics.median(r['total_seconds'] for r in rows):.3f} train {mean('train_seconds'):.3f} "
              f"waited {mean('waited_seconds'):.3f} wall {wall:.1f} versions evaluated {evals}")
PY
