"""Megatron learner layouts over N GPUs: the same model, weights and batch under 1 GPU, TP-N, EP-N, DP-N.

The driver (default mode) starts one `torchrun --standalone --nproc-per-node W` of this file per
layout (`--worker`), collects each layout's JSON, prints a markdown table and writes
OUT/megatron_layouts.json and OUT/megatron_layouts.md. Every layout builds the megatron backend
(`offpolicy.learner.backends.megatron.backend.MegatronBackend`, through `load_config` overrides) from the
same HF config with the same seeded initial weights (`model.seed`) and trains the same fixed
synthetic batch (groups x n x (prompt + response) tokens, random rewards, behaviour logprobs of
-ln(vocab) +- 1) for `--steps` steps. Step 1 sees the same weights and batch everywhere, so its loss
must agree across layouts up to arithmetic order: relative tolerance `--rtol` (default 2e-2 in
bfloat16, 1e-4 in float32) against the 1-GPU row. Tokens/s is the batch's tokens over the mean step
time after `--warmup` steps; scaling = tokens/s over the 1-GPU row's; peak memory is the largest
`torch.cuda.max_memory_allocated` over the ranks (CPU: peak RSS); ready s is the backend's start-up
(process groups, build, load the weights, DDP and optimizer: `MegatronBackend.startup`, slowest rank);
MFU = model FLOPs of the step (benchmarks/megatron_learner.py's `model_flops`) / step time / (--peak x
GPUs); `first_step_compile_s` in the JSON is what torch.compile took of the first step. After the steps rank 0 gathers the full HF weights once (`weights()`, the old gathered publish);
with `--publish N` the sharded publish is timed (benchmarks/publish.py: first and steady-state publish,
against a host copy, and the learner's stall and step slowdown with publishing overlapped).

A layout is `1` (one GPU) or tokens tpN, ppN, epN, etpN, dpN, edpN (e.g. `tp2`, `ep2`, `dp2`, `tp2ep2`):
the world is tp x pp x dp when dp is given, else ep x etp x pp x edp when edp is, else `--gpus`;
dp = world / (tp x pp); experts are split ep ways inside it (Megatron carves expert parallelism out of
data parallelism) and replicated edp = world / (ep x etp x pp) times: on 8 GPUs `ep8` (edp 1), `ep4edp2`
(EP4 x DP2: 4 expert shards, each twice; the dense layers 8 ways data-parallel) and `ep4dp4` (EP4 on 4 of them).
Before any layout runs the planner's expectation of each is printed (`offpolicy.plan.validate.predict_layout`:
step s and peak GiB on `--plan-gpu`, the table's last columns); `--dry` prints those and each layout's torchrun
command and runs nothing.

    python benchmarks/megatron_layouts.py --gpus 2 --layouts 1 tp2 ep2 dp2 --out runs/layouts
    python benchmarks/megatron_layouts.py --cpu --arch tiny-llama --gpus 2 --layouts 1 tp2 dp2   (gloo)
    python benchmarks/megatron_layouts.py --dry --arch gptoss-20b --gpus 8 --layouts ep4dp4 ep8 ep4edp2 --max-tokens 8192
    torchrun --nproc-per-node 2 benchmarks/megatron_layouts.py --worker --tp 2 --json tp2.json  (one layout)

`--arch` is a name (`qwen3-moe-small`: tests/megatron_workers.py's QWEN3_MOE_SMALL, the default;
`qwen3-dense-small`: the same without experts; `gptoss-slice`: GPT-OSS-20B's shapes with 2 layers;
`gptoss-20b`: the whole GPT-OSS-20B, 24 layers; `tiny-llama`, `tiny-qwen2`, `tiny-qwen3`, `tiny-qwen3_moe`,
`tiny-gpt_oss`: the CPU tests' configs) or an HF config.json file; `--arch-set key=JSON` changes single fields;
`--model DIR` starts from a checkpoint instead (benchmarks/startup.py --make writes GPT-OSS-20B's in MXFP4) and
`--set FIELD=VALUE` adds config overrides (learner.megatron.optimizer_offload=1.0, ...). The table's last
columns: the optimizer step's seconds (rank 0, synchronised) and the largest peak RSS of a rank (host GiB:
the optimizer's host state with optimizer_offload; the JSON's host_optimizer_gib is that state alone). `--cpu` runs
float32 on gloo through the test-only CPU shim (tests/megatron_cpu_shim.py).
Exit status: 0 when every layout ran and the step-1 losses agree, 2 when a layout failed, 3 when
they disagree (1: the driver itself failed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from offpolicy.bench.common import stop_group  # no torch: the driver stays light

ROOT = Path(__file__).resolve().parents[1]
MOE_KEYS = ("moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step",
            "mlp_only_layers", "router_aux_loss_coef", "output_router_logits")


def arch_config(name: str, sets: list[str]) -> dict:
    """The HF config dict of `--arch` (a name or a JSON file) with `--arch-set key=JSON` applied."""
    if name.endswith(".json") or os.path.sep in name:
        cfg = json.loads(Path(name).read_text())
    else:
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        import tests.megatron_workers as mw

        moe = getattr(mw, "QWEN3_MOE_SMALL", None)
        names = {f"tiny-{k}": v for k, v in mw.TINY.items()}
        if moe is not None:
            names["qwen3-moe-small"] = moe
            names["qwen3-dense-small"] = {**{k: v for k, v in moe.items() if k not in MOE_KEYS},
                                          "model_type": "qwen3"}
        from offpolicy.learner.backends.megatron.memory import GPT_OSS_20B, gpt_oss_slice

        names["gptoss-slice"] = gpt_oss_slice(2)  # GPT-OSS-20B's shapes, 2 layers (--arch-set num_hidden_layers=N)
        names["gptoss-20b"] = dict(GPT_OSS_20B)  # the whole model: 24 layers (20.9B parameters)
        if name not in names:
            raise SystemExit(f"--arch {name!r}: not a JSON file nor one of {', '.join(sorted(names))}")
        cfg = dict(names[name])
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--arch-set {item!r}: use key=JSON, e.g. num_hidden_layers=4")
        try:
            cfg[key] = json.loads(value)
        except json.JSONDecodeError:
            cfg[key] = value
    return cfg


def parse_layout(name: str, gpus: int) -> dict:
    """`1`, or tpN/ppN/epN/etpN/dpN/edpN tokens -> {name, world, tp, pp, ep, etp, dp, edp}."""
    if name == "1":
        return dict(name=name, world=1, tp=1, pp=1, ep=1, etp=1, dp=1, edp=1)
    parts = re.findall(r"(etp|edp|tp|pp|ep|dp)(\d+)", name.lower())
    if not parts or "".join(k + v for k, v in parts) != re.sub(r"[x_\-]", "", name.lower()):
        raise SystemExit(f"layout {name!r}: use 1 or tokens tpN, ppN, epN, etpN, dpN, edpN (e.g. tp2, ep2, tp2ep2, "
                         "ep4edp2)")
    got = {k: int(v) for k, v in parts}
    if min(got.values()) < 1:
        raise SystemExit(f"layout {name!r}: every size is at least 1")
    tp, pp, ep, etp = got.get("tp", 1), got.get("pp", 1), got.get("ep", 1), got.get("etp", 1)
    experts = ep * etp * pp
    world = tp * pp * got["dp"] if "dp" in got else experts * got["edp"] if "edp" in got else gpus
    if world % (tp * pp) or world % experts or ("edp" in got and world != experts * got["edp"]):
        raise SystemExit(f"layout {name!r}: {world} GPUs are not a multiple of tp x pp = {tp * pp} and of "
                         f"ep x etp x pp = {experts}" + (f" x edp {got['edp']}" if "edp" in got else ""))
    return dict(name=name, world=world, tp=tp, pp=pp, ep=ep, etp=etp, dp=world // (tp * pp), edp=world // experts)


def expectation(layout: dict, args: argparse.Namespace, hf: dict) -> dict:
    """The planner's step s, peak GiB (and its parts) and host GiB of a layout with this batch and `--set`'s
    learner.megatron.optimizer_offload / grad_reduce_in_fp32 (offpolicy/plan), or {"problem": why not}."""
    from offpolicy.plan import calibration, validate
    from offpolicy.plan.hardware import DEVICES
    from offpolicy.plan.memory import LearnerLayout
    from offpolicy.plan.shapes import from_config

    sets = dict(item.partition("=")[::2] for item in args.set)
    offload = float(sets.get("learner.megatron.optimizer_offload", 0))
    lay = LearnerLayout(layout["world"], layout["tp"], layout["pp"], layout["ep"], layout["etp"], args.max_tokens,
                        args.recompute, optimizer_offload=offload,
                        grad_fp32=sets.get("learner.megatron.grad_reduce_in_fp32", "true").lower() != "false")
    try:
        pred = validate.predict_layout(from_config(args.model or args.arch, hf), lay, args.plan_gpu,
                                       args.groups * args.samples * (args.prompt + args.response),
                                       args.prompt + args.response, calibration.load())
    except (ValueError, KeyError) as e:
        return {"problem": str(e)}
    return {**{k: pred[k] for k in ("predicted_s", "predicted_gib", "memory_gib", "predicted_host_gib", "problem")},
            "gpu_gib": DEVICES[args.plan_gpu].mem_gib}


def add_common(p: argparse.ArgumentParser) -> None:
    """Options the driver hands to every worker unchanged."""
    p.add_argument("--arch", default="qwen3-moe-small", help="arch name or HF config.json path")
    p.add_argument("--arch-set", action="append", default=[], metavar="KEY=JSON", help="change one arch field")
    p.add_argument("--groups", type=int, default=16, help="prompt groups in the batch")
    p.add_argument("--samples", type=int, default=8, help="responses per group (torchrun takes --n for itself)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--response", type=int, default=384, help="response tokens")
    p.add_argument("--steps", type=int, default=5, help="train steps (step 1 is the loss check)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    p.add_argument("--max-tokens", type=int, default=16384, help="learner.megatron.max_tokens_per_gpu")
    p.add_argument("--recompute", default="none", help="learner.megatron.recompute")
    p.add_argument("--dtype", default=None, help="model.dtype (default bfloat16 on GPU, float32 with --cpu)")
    p.add_argument("--seed", type=int, default=0, help="model.seed and the batch's seed")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--no-gather", action="store_true", help="skip timing the HF weight gather")
    p.add_argument("--publish", type=int, default=0, metavar="N",
                   help="time N sharded publishes alone and N overlapped with train steps (benchmarks/publish.py)")
    p.add_argument("--cpu", action="store_true", help="gloo, float32, through the test-only CPU shim")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="model.path: start from this HF checkpoint (its config.json is the arch; e.g. benchmarks/startup.py "
                        "--make's MXFP4 GPT-OSS) instead of --arch's seeded weights")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a config override for every layout, e.g. learner.megatron.optimizer_offload=1.0")
    p.add_argument("--peak", type=float, default=989e12,
                   help="bf16 peak FLOP/s of one GPU for the MFU column (989e12: H100 SXM; an H200's is the same)")
    p.add_argument("--plan-gpu", default="h200", help="the planner's GPU preset for the expected columns (h100, h200)")


# -- worker: one layout, every rank of it ----------------------------------------------------------

def worker(args: argparse.Namespace) -> None:
    import resource

    if args.cpu:
        sys.path.insert(0, str(ROOT))
        from tests.megatron_cpu_shim import install

        install()
    import torch
    import torch.distributed as dist

    from offpolicy.bench.synthetic import synthetic_batch
    from offpolicy.config import load_config
    from offpolicy.learner.backends.megatron.backend import MegatronBackend

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.cpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cuda = not args.cpu and torch.cuda.is_available()
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    hf = arch_config(str(Path(args.model) / "config.json") if args.model else args.arch, args.arch_set)
    model = [f"model.path={args.model}"] if args.model else [f"model.arch={json.dumps(hf)}"]
    cfg = load_config(None, [
        *model, f"model.dtype={dtype}", f"model.seed={args.seed}", "learner.backend=megatron",
        f"learner.device={'cuda' if cuda else 'cpu'}", f"learner.lr={args.lr}", f"rollout.n_samples={args.samples}",
        f"rollout.max_new_tokens={args.response}", f"learner.batch_groups={args.groups}",
        f"learner.micro_batch_groups={args.groups}", f"learner.megatron.tp={args.tp}", f"learner.megatron.pp={args.pp}",
        f"learner.megatron.ep={args.ep}", f"learner.megatron.etp={args.etp}",
        f"learner.megatron.max_tokens_per_gpu={args.max_tokens}", f"learner.megatron.recompute={args.recompute}",
        # tensor parallelism with sequence parallelism (MoE needs it for tp > 1; dense layers gain memory)
        f"learner.megatron.sequence_parallel={'true' if args.tp > 1 else 'false'}", *args.set])
    t0 = time.perf_counter()
    backend = MegatronBackend(cfg)
    build_s = time.perf_counter() - t0
    optimizer_s = _time_optimizer(backend, sync=torch.cuda.synchronize if cuda else lambda: None)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    stats, times, gather = [], [], {}
    if backend.par.rank != 0:
        backend.serve()
    else:
        groups, adv = synthetic_batch(seed=args.seed, groups=args.groups, n=args.samples, prompt=args.prompt,
                                      response=args.response, vocab=int(hf["vocab_size"]))
        for _ in range(args.steps):
            sync()
            t = time.perf_counter()
            stats.append(backend.train_step(groups, adv))
            sync()
            times.append(time.perf_counter() - t)
            if len(times) == 1:
                gather["first_step_compile_s"] = _compile_seconds()
        timed = times[args.warmup:] or times[-1:]
        step = sum(timed) / len(timed)
        if not args.no_gather:
            t = time.perf_counter()
            tensors = numel = 0
            for _, v in backend.weights():
                tensors += 1
                numel += v.numel()
            gather = dict(gather_s=time.perf_counter() - t, hf_tensors=tensors, params=numel)
        if args.publish:
            from publish import measure  # benchmarks/publish.py, beside this script

            def train():
                backend.train_step(groups, adv)
                sync()

            gather.update(measure(backend, args.publish, train, cuda, step_s=step))
        backend.close()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    mems = [None] * world
    dist.all_gather_object(mems, (peak, rss), group=backend.par.control)
    if backend.par.rank == 0:
        tokens = args.groups * args.samples * (args.prompt + args.response)
        from megatron_learner import model_flops  # benchmarks/megatron_learner.py, beside this script

        flops = model_flops(backend.arch, groups)
        peaks = [m[0] for m in mems if m[0] is not None]
        from offpolicy.learner.backends.megatron import offload

        timed_opt = optimizer_s[args.warmup:len(times)] or optimizer_s[-1:]
        out = dict(world=world, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, dp=backend.par.dp,
                   edp=backend.par.edp, dtype=dtype,
                   device=torch.cuda.get_device_name() if cuda else "cpu", build_s=build_s,
                   ready_s=backend.startup.get("ready", build_s), startup=backend.startup,
                   loss=stats[0]["loss"], grad_norm=stats[0]["grad_norm"], entropy=stats[0]["entropy"],
                   logprob_diff_mean=stats[0]["logprob_diff_mean"], losses=[s["loss"] for s in stats],
                   grad_norms=[s["grad_norm"] for s in stats], step_times=times, step_s=step,
                   tokens_per_step=tokens, tokens_per_s=tokens / step, model_tflop_per_step=flops / 1e12,
                   mfu=flops / step / (args.peak * world) if cuda else None,
                   peak_mem_gib=max(peaks) if peaks else None, peak_mem_gib_per_rank=[m[0] for m in mems],
                   peak_rss_gib=max(m[1] for m in mems), optimizer_s=sum(timed_opt) / max(1, len(timed_opt)),
                   host_optimizer_gib=offload.host_bytes(backend.opt) / 2**30,
                   offload=cfg.learner.megatron.optimizer_offload, **gather)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(json.dumps({k: v for k, v in out.items() if not isinstance(v, list)}))
    dist.destroy_process_group()


def _time_optimizer(backend, sync) -> list[float]:
    """Seconds of every optimizer step of this rank (synchronised before and after: the timed steps' own
    optimizer share; on the host with learner.megatron.optimizer_offload), appended to the returned list."""
    seconds, plain = [], backend.opt.step

    def step(*a, **k):
        sync()
        t = time.perf_counter()
        out = plain(*a, **k)
        sync()
        seconds.append(time.perf_counter() - t)
        return out

    backend.opt.step = step
    return seconds


def _compile_seconds() -> float | None:
    """Seconds torch.compile spent so far in this process (dynamo's own record: forward graphs as traced,
    backward graphs as compiled at their first backward), or None."""
    try:
        from torch._dynamo.utils import compilation_time_metrics

        return sum(sum(v) for k, v in compilation_time_metrics.items()
                   if k == "_compile.compile_inner" or k.endswith("bw_compiler"))
    except Exception:
        return None


# -- driver: every layout, one torchrun each ---------------------------------------------------------

def layout_command(layout: dict, argv_common: list[str], out: Path) -> list[str]:
    """The torchrun command of one layout, its rank 0 writing `out`."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(layout["world"]),
            str(Path(__file__).resolve()), "--worker", "--json", str(out), *argv_common,
            *(f"--{k}={layout[k]}" for k in ("tp", "pp", "ep", "etp"))]


def run_layout(layout: dict, args: argparse.Namespace, argv_common: list[str], tmp: Path) -> dict:
    out = tmp / f"{layout['name']}.json"
    # with --out the log is written there as the layout runs: a layout cut by an outer timeout leaves it too
    log = Path(args.out) / f"{args.name}_{layout['name']}.log" if args.out else tmp / f"{layout['name']}.log"
    cmd = layout_command(layout, argv_common, out)
    print(f"== layout {layout['name']}: {' '.join(cmd)}", flush=True)
    t = time.perf_counter()
    with open(log, "w") as f:  # its own session, so a timeout takes torchrun's workers down with it
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            rc, late = _wait(proc, out, t + args.layout_timeout, args.exit_grace)
            if rc is None:
                rc = f"timeout after {args.layout_timeout:.0f} s"
                stop_group(proc, 15)  # torchrun stops its workers, which run in sessions of their own
            elif late is not None:
                print(f"   layout {layout['name']}: result written, still exiting {late:.0f} s later: stopped",
                      flush=True)
        except BaseException:  # the driver itself is stopped (Ctrl-C, SIGTERM from `timeout`)
            stop_group(proc, 15)  # torchrun stops its workers, which run in sessions of their own
            raise
    wall = time.perf_counter() - t
    text = log.read_text(errors="replace")
    if rc != 0 or not out.exists():
        tail = "\n".join(text.splitlines()[-40:])
        reason = _reason(text) or f"exit {rc}"
        print(f"   layout {layout['name']} failed ({rc}) after {wall:.0f} s: {reason}\n   log ends:\n{tail}",
              flush=True)
        return {**layout, "error": reason, "exit": str(rc), "log_tail": tail, "wall_s": wall}
    result = {**layout, **json.loads(out.read_text()), "wall_s": wall}
    print(f"   loss {result['loss']:.6f}  grad_norm {result['grad_norm']:.6f}  "
          f"{result['tokens_per_s']:,.0f} tokens/s  ({wall:.0f} s)", flush=True)
    return result


def _wait(proc: subprocess.Popen, out: Path, deadline: float, grace: float) -> tuple[int | None, float | None]:
    """(exit code, None) once torchrun exits by itself before `deadline` (perf_counter), (None, None) past it;
    (0, seconds) when its result was written but its ranks were still tearing down `grace` s later (a 24-layer
    model's ranks took minutes to exit after writing): the group is stopped then, and the result stands."""
    written = None
    while True:
        try:
            return proc.wait(timeout=1.0), None
        except subprocess.TimeoutExpired:
            pass
        now = time.perf_counter()
        if written is None and out.exists():
            written = now
        if written is not None and now - written > grace:
            stop_group(proc, 15)
            return 0, now - written
        if now > deadline:
            return None, None


def _reason(log: str) -> str | None:
    """The first rank's exception line in a torchrun log (`[rank0]: ValueError: ...`), if any."""
    found = re.findall(r"^(?:\[rank\d+\]: )?((?:[\w.]+\.)?\w*(?:Error|Exception)\w*: .+)$", log, re.M)
    found = [f for f in found if not f.startswith(("torch.distributed.elastic", "ChildFailedError"))]
    return found[0][:300] if found else None


def driver(args: argparse.Namespace, argv_common: list[str]) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so a running layout's session is killed too
    layouts = [parse_layout(name, args.gpus) for name in args.layouts]
    dtype = args.dtype or ("float32" if args.cpu else "bfloat16")
    rtol = args.rtol if args.rtol is not None else (1e-4 if dtype in ("float32", "float64") else 2e-2)
    # a bad --arch (or --model) fails here, before any layout starts
    hf = arch_config(str(Path(args.model) / "config.json") if args.model else args.arch, args.arch_set)
    from layouts_table import compare, expected, table  # beside this script

    for layout in layouts if not args.cpu else []:  # the planner's expectation (no CPU figures)
        layout["expected"] = expectation(layout, args, hf)
        print(f"expected (offpolicy plan, {args.plan_gpu}): {expected(layout)}", flush=True)
    if args.dry:
        for layout in layouts:
            print(f"== layout {layout['name']}: {' '.join(layout_command(layout, argv_common, Path('TMP.json')))}")
        return 2 if any((lay.get("expected") or {}).get("problem") for lay in layouts) else 0
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="megatron-layouts-") as tmp:
        rows = [run_layout(layout, args, argv_common, Path(tmp)) for layout in layouts]
    doc = dict(bench="megatron_layouts", command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
               arch=args.arch, hf_config=hf, dtype=dtype, gpus=args.gpus, steps=args.steps, warmup=args.warmup,
               params=next((r["params"] for r in rows if "params" in r), None),
               batch=dict(groups=args.groups, samples=args.samples, prompt=args.prompt, response=args.response,
                          max_tokens=args.max_tokens), rtol=rtol, layouts=rows, unix_time=round(time.time(), 1))
    doc.update(compare(rows, rtol))
    md = table(doc)
    print("\n" + md)
    if args.out:
        (Path(args.out) / f"{args.name}.json").write_text(json.dumps(doc, indent=2) + "\n")
        (Path(args.out) / f"{args.name}.md").write_text(f"`{doc['command']}`\n\n{md}\n")
        print(f"\nwritten: {Path(args.out) / (args.name + '.json')}")
    if any("error" in r for r in rows):
        return 2
    return 0 if doc["agree"] else 3


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p)
    p.add_argument("--gpus", type=int, default=2, help="GPUs (ranks) of a layout that names no dp")
    p.add_argument("--layouts", nargs="+", default=["1", "tp2", "ep2", "dp2"])
    p.add_argument("--rtol", type=float, default=None, help="step-1 loss tolerance (default by dtype)")
    p.add_argument("--layout-timeout", type=float, default=300, help="seconds one layout may take")
    p.add_argument("--exit-grace", type=float, default=30,
                   help="seconds a layout's ranks may take to exit after writing their result, then stopped")
    p.add_argument("--out", default=None, help="directory for NAME.json, NAME.md and the layouts' logs")
    p.add_argument("--name", default="megatron_layouts", help="file name stem under --out")
    p.add_argument("--dry", action="store_true", help="print each layout's expectation and torchrun command, run none "
                   "(exit 2 when the planner says a layout cannot run the model)")
    p.add_argument("--worker", action="store_true", help="(internal) run one layout as a torchrun rank")
    p.add_argument("--json", default=None, help="(worker) where rank 0 writes the layout's result")
    for k in ("tp", "pp", "ep", "etp"):
        p.add_argument(f"--{k}", type=int, default=1, help=f"(worker) learner.megatron.{k}")
    args = p.parse_args(argv)
    if args.worker:
        if not args.json:
            p.error("--worker needs --json")
        worker(args)
        return 0
    # the options every worker gets: the common ones exactly as given here
    common = argparse.ArgumentParser(add_help=False)
    add_common(common)
    known, _ = common.parse_known_args(argv)
    argv_common = []
    for action in common._actions:
        value = getattr(known, action.dest)
        if action.option_strings[0] in ("--arch-set", "--set"):
            argv_common += [x for v in value for x in (action.option_strings[0], v)]
        elif isinstance(action, argparse._StoreTrueAction):
            argv_common += [action.option_strings[0]] if value else []
        elif value is not None:
            argv_common += [action.option_strings[0], str(value)]
    return driver(args, argv_common)


if __name__ == "__main__":
    sys.exit(main())
