#!/usr/bin/env bash
# Learning with low-bit rollouts on the tiny GPT-OSS (issue 53): configs/gptoss-tiny.yaml (Megatron learner on
# the CPU, two torch rollout daemons, one step off-policy) with `algo.logp_old=recompute` (decoupled PPO: the
# rollout's logprobs enter only through the corrections' weight pi_learner / pi_rollout per token), rollouts on
# native versions (float32, the control) and on fp8 (the 2-D attention projections, 128 x 128 blocks) and mxfp4
# (the MoE experts) versions, each with no correction (`-none`), token TIS (`-tis`, threshold 2) and icepop
# (`-icepop`, [0.5, 2]); `native-tis` / `native-icepop` are the corrections' controls (they also act on the
# staleness-1 version gap, which native rollouts have too).
# Seeds in model.seed, data.synthetic.seed and rollout.seed. Two runs at a time, each on its own ports, Megatron
# rendezvous port and weight store.
#     bash benchmarks/lowbit_learning.sh OUT_DIR            (9 variants x 2 seeds x 400 steps: ~45 min on 2 cores)
#     SEEDS="0 1" STEPS=400 VARIANTS="native fp8-none fp8-tis mxfp4-none mxfp4-tis" bash benchmarks/lowbit_learning.sh OUT
#     bash benchmarks/lowbit_learning.sh OUT table           (only the table, from the runs in OUT)
# Prints a markdown table from each run's summary.json and metrics.jsonl (docs/algorithm.md, "Low-bit rollouts").
set -u
OUT=$(realpath -m "${1:-runs/lowbit-learning}")
MODE=${2:-run}
CONFIG=$(realpath "$(dirname "$0")/../configs/gptoss-tiny.yaml")
SEEDS=${SEEDS:-"0 1"}
STEPS=${STEPS:-400}
VARIANTS=${VARIANTS:-"native native-tis native-icepop fp8-none fp8-tis fp8-icepop mxfp4-none mxfp4-tis mxfp4-icepop"}
mkdir -p "$OUT"
run() {  # NAME PORT OVERRIDES...
    local name=$1 port=$2 t0
    shift 2
    t0=$(date +%s)
    offpolicy run "$CONFIG" run.name="$name" run.dir="$OUT" weights.root="/dev/shm/offpolicy-lowbit-$port" \
        transport.work_port="$port" transport.announce_port=$((port + 1)) metrics.port=$((port + 3000)) \
        learner.megatron.master_port=$((port + 2)) learner.total_steps="$STEPS" algo.logp_old=recompute "$@" \
        > "$OUT/$name.log" 2>&1 || echo "$name failed: see $OUT/$name.log" >&2
    rm -rf "/dev/shm/offpolicy-lowbit-$port"  # the run frees its versions; its store's directories stay
    echo "$name $(( $(date +%s) - t0 )) s" >&2
}
if [ "$MODE" = run ]; then
    i=0
    for seed in $SEEDS; do
        for v in $VARIANTS; do
            fmt=${v%%-*}
            corr=${v#*-}
            extra=()
            [ "$fmt" != native ] && extra=("weights.formats=[$fmt]" rollout.weights_format="$fmt" "weights.fp8_block_size=[128, 128]")
            case $corr in
                tis) extra+=(algo.tis=token) ;;
                icepop) extra+=(algo.icepop=true) ;;
            esac
            run "$v-s$seed" $((5700 + 10 * (i % 2))) model.seed="$seed" data.synthetic.seed="$seed" \
                rollout.seed="$seed" "${extra[@]}" &
            i=$((i + 1))
            (( i % 2 == 0 )) && wait
        done
    done
    wait
fi
python3 - "$OUT" "$VARIANTS" <<'PY'
import glob, json, os, statistics as st, sys

rows = {}
for d in sorted(glob.glob(os.path.join(sys.argv[1], "*-s[0-9]"))):
    if not os.path.exists(f"{d}/summary.json"):
        continue
    v, seed = os.path.basename(d).rsplit("-s", 1)
    s = json.load(open(f"{d}/summary.json"))
    m = [json.loads(line) for line in open(f"{d}/metrics.jsonl") if line.strip()]
    w = lambda a, b: st.mean(x["reward_mean"] for x in m[a:b])
    rows.setdefault(v, []).append(dict(
        seed=seed, steps=s["steps"], init=s["initial_reward_mean"], final=s["final_reward_mean"], last=w(-20, None),
        curve=[w(a, a + 20) for a in range(0, len(m), 20)],
        reach=next((x["step"] for x in m if x["reward_mean"] >= 0.5), None),
        diff=st.mean(x["logprob_diff_mean"] for x in m), diffmax=max(x["logprob_diff_max"] for x in m),
        tis=st.mean(x.get("tis_truncated_frac", 0) for x in m), ice=st.mean(x.get("icepop_masked_frac", 0) for x in m),
        stale=st.mean(x["staleness_mean"] for x in m), ent=st.mean(x["entropy"] for x in m[-20:]),
        wall=s["wall_seconds"]))
order = [v for v in sys.argv[2].split() if v in rows] + sorted(set(rows) - set(sys.argv[2].split()))
seeds = lambda rs: " / ".join(r["seed"] for r in rs)
print("| rollouts | correction | seeds | steps | initial reward | final reward | mean of the last 20 steps | over seeds | "
      "first step >= 0.5 | logprob_diff mean / max | TIS truncated / icepop masked | entropy, last 20 | wall s |\n"
      + "| --- " * 13 + "|")
for v in order:
    rs = sorted(rows[v], key=lambda r: r["seed"])
    fmt, _, corr = v.partition("-")
    j = lambda k, f: " / ".join("-" if r[k] is None else f.format(r[k]) for r in rs)
    print(f"| {fmt} | {corr or 'none'} | {seeds(rs)} | {j('steps', '{}')} | {j('init', '{:.3f}')} | {j('final', '{:.3f}')} | "
          f"{j('last', '{:.3f}')} | **{st.mean(r['last'] for r in rs):.3f}** | {j('reach', '{}')} | "
          f"{st.mean(r['diff'] for r in rs):.3f} / {max(r['diffmax'] for r in rs):.1f} | "
          f"{100 * st.mean(r['tis'] for r in rs):.2f} % / {100 * st.mean(r['ice'] for r in rs):.2f} % | "
          f"{j('ent', '{:.2f}')} | {j('wall', '{:.0f}')} |")
print("\nReward by 20-step windows:\n")
for v in order:
    for r in sorted(rows[v], key=lambda r: r["seed"]):
        print(f"- {v} s{r['seed']}: " + " ".join(f"{c:.2f}" for c in r["curve"]))
PY
