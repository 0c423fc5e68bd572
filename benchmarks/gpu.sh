#!/usr/bin/env bash
# The GPU-machine run behind docs/benchmarks.md (issues 9 and 17). From the repository root:
#     bash benchmarks/gpu.sh OUT_DIR [weights rollout weights16 pipeline transport defaults formats mismatch]
# (default: all). `formats` and `mismatch` are issue 15's: publishing GPT-OSS-shaped versions in fp8 and
# mxfp4 (`bench weights --formats`), and the rollout/learner logprob mismatch of native, fp8 and mxfp4
# rollouts on the GPT-OSS-20B slice (benchmarks/lowbit_mismatch.py).
# `defaults` sets the weight store's old default (fresh files, sha256) beside the new GPU default (auto:
# recycled files through registered maps, no hash); `pipeline` runs with the defaults as they are
# (on a GPU: static cache + compile, recycled unhashed versions).
# Installs this checkout (no dependencies: torch, transformers, safetensors, uvloop and
# prometheus-client come with the machine) plus the pyzmq and msgspec wheels in .whl/ into
# /tmp/site, then runs the four benchmarks; their JSON lands in OUT_DIR, the log in OUT_DIR/gpu.log.
set -u
OUT=$(realpath -m "${1:-runs/bench-gpu}")
shift
WANT=" ${*:-weights rollout weights16 pipeline transport defaults formats mismatch} "
mkdir -p "$OUT"
WORK=$(mktemp -d)
REPO=$PWD
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/pyzmq-*.whl .whl/msgspec-*.whl . || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
cd "$WORK" || exit 1
bench() {  # NAME SECONDS ARGS...: one benchmark, its tables to the log, its JSON to OUT
    local name=$1 limit=$2 dir="$WORK/$1"
    shift 2
    [[ $WANT == *" $name "* ]] || return 0
    echo "== offpolicy bench $name $*"
    timeout "$limit" python3 -m offpolicy.services.cli bench "$@" --out "$dir" && cp "$dir/$1.json" "$OUT/$name.json"
}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    nproc; free -g; df -h /dev/shm; python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__)'
    bench weights 300 weights --sizes 1 4 --repeat 3
    bench rollout 240 rollout --compile
    bench weights16 300 weights --sizes 16 --repeat 2 --modes none none+reuse
    bench pipeline 300 pipeline --dir "$WORK/runs"
    bench transport 60 transport
    bench defaults 300 weights --sizes 1 4 16 --repeat 3 --modes sha256 none+reuse+maps
    bench formats 300 weights --formats fp8 mxfp4 --shape gpt_oss --sizes 4 --repeat 2 --modes none+reuse+maps
    if [[ $WANT == *" mismatch "* ]]; then
        echo "== lowbit_mismatch"
        timeout 300 python3 "$REPO/benchmarks/lowbit_mismatch.py" --arch gptoss-slice --layers 2 --out "$OUT/mismatch.json"
    fi
} 2>&1 | tee "$OUT/gpu.log"
