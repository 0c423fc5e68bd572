#!/usr/bin/env bash
# vLLM 0.26 on a lent GPU machine, carried in parts (deploy/gpu/pack-vllm.sh made them in .gpu/). From the
# repository root on the GPU machine, one call per part while the machine stays held (/tmp stays):
#     bash deploy/gpu/vllm.sh stash                 # keep the parts this call carried in /tmp/vllm-parts
#     bash deploy/gpu/vllm.sh install               # all parts there: check, unpack into /tmp/vsite; this checkout
#                                                   # and .whl/ (pyzmq, msgspec, megatron-core) into /tmp/site
#     bash deploy/gpu/vllm.sh smoke OUT [MODEL_DIR] # import vllm; a server per model: an OpenAI completion
#     bash deploy/gpu/vllm.sh env                   # prints the PYTHONPATH line the rest uses
# smoke starts `python -m vllm.entrypoints.openai.api_server` (skip_tokenizer_init, token-id prompts) on the tiny
# Llama of configs/quickstart-vllm.yaml in bf16, then on MODEL_DIR if given (GPT-OSS-20B's MXFP4 checkpoint from
# benchmarks/startup.py --make: served natively in MXFP4), and POSTs /v1/completions; logs and answers in OUT.
set -u
PARTS=/tmp/vllm-parts SITE=/tmp/vsite OURS=/tmp/site
export PYTHONPATH=$OURS:$SITE PYTHONUNBUFFERED=1
cmd=${1:-}; shift || true
case $cmd in
    stash)
        mkdir -p $PARTS && cp -v .gpu/vllm.* .gpu/zstandard-*.whl $PARTS/ 2>/dev/null; ls $PARTS ;;
    install)
        [[ -f $PARTS/vllm.sha256 ]] || cp .gpu/vllm.sha256 $PARTS/ 2>/dev/null
        want=$(cat $PARTS/vllm.sha256) got=$(cat $PARTS/vllm.part* | sha256sum | cut -d' ' -f1)
        [[ $want == "$got" ]] || { echo "parts incomplete or damaged: sha256 $got, want $want ($(ls $PARTS))"; exit 1; }
        unzst() { zstd -d --long=27 -q; }  # the GPU image has no zstd: the zstandard wheel pack-vllm.sh put in .gpu/
        if ! command -v zstd > /dev/null; then
            python3 -m pip install -q --no-deps --target /tmp/zsite $PARTS/zstandard-*.whl || exit 1
            unzst() { PYTHONPATH=/tmp/zsite python3 -c "import sys, zstandard
zstandard.ZstdDecompressor(max_window_size=2**27).copy_stream(sys.stdin.buffer, sys.stdout.buffer)"; }
        fi
        rm -rf $SITE && mkdir -p $SITE && cat $PARTS/vllm.part* | unzst | tar -C $SITE -xf - || exit 1
        python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
            --target $OURS .whl/pyzmq-*.whl .whl/msgspec-*.whl .whl/megatron_core-*.whl . || exit 1
        python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" ;;
    smoke)
        out=$(realpath -m "${1:?OUT}"); model=${2:-}; mkdir -p "$out"
        python3 -c "import vllm; print('import vllm', vllm.__version__)" || exit 1
        tiny=$(mktemp -d)/tiny
        python3 - "$tiny" <<'PY' || exit 1
import sys
import torch
from offpolicy.config import load_config
from offpolicy.models.build import build_model
cfg = load_config("configs/quickstart-vllm.yaml", ["model.dtype=bfloat16"])
build_model(cfg.model, torch.device("cpu")).save_pretrained(sys.argv[1])
PY
        rc=0
        for m in "$tiny" ${model:+"$model"}; do
            name=$(basename "$m")
            # shellcheck disable=SC2046
            python3 - "$m" 8311 "$out/smoke-$name" ${SMOKE_ARGS:-} $([[ $m != "$tiny" ]] && echo --max-model-len 4096) \
                <<'PY' || rc=1
import json, subprocess, sys, time, urllib.error, urllib.request
from offpolicy.rollout.engines.vllm.launch import wait_healthy
model, port, out, extra = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
url, t0 = f"http://127.0.0.1:{port}", time.monotonic()
cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--skip-tokenizer-init",
       "--dtype", "bfloat16", "--gpu-memory-utilization", "0.5", "--port", str(port), *extra]
proc = subprocess.Popen(cmd, stdout=open(out + ".log", "w"), stderr=subprocess.STDOUT)
try:
    wait_healthy(url, proc, out + ".log", 600)
    print(f"{model}: healthy after {time.monotonic() - t0:.1f} s")
    body = dict(model=model, prompt=[1, 2, 3, 4, 5], max_tokens=16, temperature=1.0, return_token_ids=True)
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.load(r)
    except urllib.error.HTTPError as e:
        sys.exit(f"  /v1/completions answered {e.code}: {e.read().decode(errors='replace')[:500]}")
    open(out + ".json", "w").write(json.dumps(answer, indent=1))
    c = answer["choices"][0]
    print(f"  /v1/completions in {time.monotonic() - t:.2f} s: token ids {c['token_ids']}, finish {c['finish_reason']}")
finally:
    proc.terminate()
    proc.wait()
PY
            grep -E "backend|quantization|Model loading took|KV cache|Error" "$out/smoke-$name.log" | head -n 12
        done
        exit $rc ;;
    env) echo "export PYTHONPATH=$PYTHONPATH" ;;
    *) echo "usage: $0 stash | install | smoke OUT [MODEL_DIR] | env"; exit 2 ;;
esac
