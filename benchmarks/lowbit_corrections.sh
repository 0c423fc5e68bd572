#!/usr/bin/env bash
# What algo.tis / algo.icepop do for fp8 rollouts (issue 15), on a CPU: the quickstart task trained with
# `algo.logp_old=recompute` (decoupled PPO; the corrections weigh pi_learner / pi_rollout per token),
# native rollouts (control) and fp8 rollouts with no correction, token TIS (threshold 2) and icepop
# ([0.5, 2]), seeds 0-2 (`model.seed`, `data.seed`), two runs at a time on their own ports; fp8 in 128 x 128
# blocks, as measured in docs/weights.md (weights.fp8_block_size auto would give 64 x 64 for this model).
#     bash benchmarks/lowbit_corrections.sh OUT_DIR        (about 7 minutes on 2 cores)
# Prints a markdown table from each run's summary.json and metrics.jsonl (docs/weights.md).
set -u
OUT=$(realpath -m "${1:-runs/lowbit-corrections}")
CONFIG=$(realpath "$(dirname "$0")/../configs/quickstart.yaml")
mkdir -p "$OUT"
run() {  # NAME PORT OVERRIDES...
    local name=$1 port=$2
    shift 2
    offpolicy run "$CONFIG" run.name="$name" run.dir="$OUT" transport.work_port="$port" \
        transport.announce_port=$((port + 1)) metrics.port=$((port + 3000)) algo.logp_old=recompute "$@" \
        > "$OUT/$name.log" 2>&1 || echo "$name failed: see $OUT/$name.log" >&2
}
i=0
for seed in 0 1 2; do
    for v in native none tis icepop; do
        case $v in
            native) extra=() ;;
            none) extra=("weights.formats=[fp8]" rollout.weights_format=fp8 "weights.fp8_block_size=[128, 128]") ;;
            tis) extra=("weights.formats=[fp8]" rollout.weights_format=fp8 "weights.fp8_block_size=[128, 128]" algo.tis=token) ;;
            icepop) extra=("weights.formats=[fp8]" rollout.weights_format=fp8 "weights.fp8_block_size=[128, 128]" algo.icepop=true) ;;
        esac
        run "$v-s$seed" $((5600 + 10 * (i % 2))) model.seed=$seed data.seed=$seed "${extra[@]}" &
        i=$((i + 1))
        (( i % 2 == 0 )) && wait
    done
done
wait
python3 - "$OUT" <<'PY'
import glob, json, os, statistics as st, sys

rows = {}
for d in sorted(glob.glob(os.path.join(sys.argv[1], "*-s[0-9]"))):
    v = os.path.basename(d).rsplit("-s", 1)[0]
    m = [json.loads(line) for line in open(f"{d}/metrics.jsonl")]
    rows.setdefault(v, []).append(dict(
        final=json.load(open(f"{d}/summary.json"))["final_reward_mean"], last=st.mean(x["reward_mean"] for x in m[-20:]),
        reach=next((x["step"] for x in m if x["reward_mean"] >= 0.9), None),
        diff=st.mean(x["logprob_diff_mean"] for x in m), diffmax=max(x["logprob_diff_max"] for x in m),
        tis=st.mean(x.get("tis_truncated_frac", 0) for x in m), ice=st.mean(x.get("icepop_masked_frac", 0) for x in m),
        gmax=max(x["grad_norm"] for x in m)))
print("| rollouts, correction | final reward (seeds 0 / 1 / 2) | mean of the last 20 steps | first step >= 0.9 | "
      "logprob_diff mean | max | TIS truncated | icepop masked | max grad norm |\n" + "| --- " * 9 + "|")
for v in ("native", "none", "tis", "icepop"):
    rs = rows.get(v, [])
    if rs:
        j = lambda k, f: " / ".join("-" if r[k] is None else f.format(r[k]) for r in rs)
        print(f"| {v} | {j('final', '{:.3f}')} | {st.mean(r['last'] for r in rs):.3f} | {j('reach', '{}')} | "
              f"{st.mean(r['diff'] for r in rs):.4f} | {max(r['diffmax'] for r in rs):.2f} | "
              f"{100 * st.mean(r['tis'] for r in rs):.2f} % | {100 * st.mean(r['ice'] for r in rs):.2f} % | "
              f"{max(r['gmax'] for r in rs):.1f} |")
PY
