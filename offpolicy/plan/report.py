"""The planner's output: ranked markdown tables, the figures behind them, and a plot.

`markdown` gives two tables over the same ranking (memory and part times; throughput at
max_staleness 0 and 1 with each side's idle share, the speed-up and what the workload allows at most:
`Evaluation.speedup_bound`) and lists every calibration constant the
prediction read, marking the ones that are not this project's measurements (public figures,
assumptions). `plot` draws tokens/s at staleness 0 and 1 per layout and the part times behind them
(matplotlib without a display, as offpolicy/loggers/plot.py does).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from offpolicy.plan.calibration import Calibration
from offpolicy.plan.evaluate import Evaluation
from offpolicy.plan.hardware import GIB, Cluster
from offpolicy.plan.shapes import Shape
from offpolicy.plan.workload import Workload


def _n(x: float, digits: int = 3) -> str:
    if x != x:  # nan
        return "-"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.{digits}g}"


def _mem(e: Evaluation) -> tuple[str, str]:
    lm, rm = e.learner_mem, e.rollout_mem
    learner = (f"{lm.total / GIB:.1f} ({lm.params / GIB:.1f} + {lm.grads / GIB:.1f} + {lm.optimizer / GIB:.1f} + "
               f"{lm.activations / GIB:.1f} + {lm.logits / GIB:.1f})")
    rollout = f"{rm.params / GIB:.1f} + {rm.kv_cache / GIB:.1f}"
    return learner, rollout


def markdown(evals: list[Evaluation], shape: Shape, cluster: Cluster, wl: Workload, cal: Calibration,
             top: int = 0) -> str:
    shown = evals[:top] if top else evals
    lines = [f"**{shape.name}** ({shape.params / 1e9:.2f} B parameters, {shape.active_params / 1e9:.2f} B active per "
             f"token) on {cluster.nodes} x {cluster.gpus_per_node} {cluster.device.name} ({cluster.inter_gbps:g} GB/s "
             f"between nodes); {wl.batch_groups} groups x {wl.n} responses a step, prompts of {wl.prompt_tokens} "
             f"tokens, responses {wl.lengths} cut at {wl.max_new_tokens} (mean {wl.mean_response():.0f}); publish path "
             f"`{wl.publish}`, " + ("the first versions into fresh pages (a run's start)" if wl.fresh_pages else
                                   "steady state (versions into recycled page-locked files)")
             + f"; {wl.steps} simulated steps, means after {wl.warmup}.", "",
             "Memory per GPU in GiB (learner: total (params + grads + optimizer + activations + logits) on its "
             "busiest stage; rollout: weights + KV pool) and part times in seconds (lease: one lease's generation, "
             "mean / longest; publish: each rank writes its share in the background while the next step trains, the "
             "learner stalls for the snapshot; relay: to the last rollout node; load: a server's, in the background "
             "(torch engine's double buffer: the swap waits for what is left) or a stall (in place / rebuild).", "",
             "| # | layout | learner mem | rollout mem | fits | T_train | lease (groups) | publish (stall) | "
             "relay | load |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, e in enumerate(shown, 1):
        c, p = e.candidate, e.parts
        lmem, rmem = _mem(e)
        lay = c.learner
        label = (c.label(cluster) + f", micro-batch {lay.max_tokens_per_gpu} tokens"
                 + (f", recompute {lay.recompute}" if lay.recompute != "none" else ""))
        fits = "yes" if e.fits else "**no**: " + "; ".join(e.problems)
        if not p:
            lines.append(f"| {i} | {label} | {lmem} | {rmem} | {fits} | | | | | |")
            continue
        r1 = e.runs.get(1) or e.runs.get(0)
        lines.append(f"| {i} | {label} | {lmem} | {rmem} | {fits} | {_n(p['train_s'])} | "
                     f"{_n(r1['lease_s'])} / {_n(r1['lease_max_s'])} ({p['groups_per_lease']}) | "
                     f"{_n(p['publish_s'])} ({_n(p['stall_s'])}) | {_n(p['relay_s'])} | "
                     f"{_load(p)} |")
    lines += ["", "| # | s=0 step s | s=0 steps/h | s=0 tokens/s | s=0 idle learner / rollouts | s=1 step s | "
              "s=1 steps/h | s=1 tokens/s | s=1 idle learner / rollouts | speed-up 0 -> 1 (bound) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, e in enumerate(shown, 1):
        cells = []
        for s in (0, 1):
            r = e.runs.get(s)
            cells += ([_n(r["step_s"]), _n(r["steps_per_hour"]), _n(r["tokens_per_s"]),
                       f"{r['learner_idle']:.0%} / {r['rollout_idle']:.0%}"] if r else ["-"] * 4)
        sp, bound = e.speedup(), e.speedup_bound()
        lines.append(f"| {i} | " + " | ".join(cells) + (f" | {sp:.2f}x ({bound:.2f}x) |" if sp == sp else " | - |"))
    best = next((e for e in evals if e.fits and e.runs and not e.candidate.colocated), None)
    if best is not None and best.candidate.learner_gpus and cluster.nodes == 1:
        lines += ["", "Run the first layout on this node (`offpolicy run`, docs/deploy.md; your config as run.yaml):", "",
                  "    " + run_command(best, cluster)]
    elif best is not None and not best.candidate.learner_gpus:
        lines += ["", "Submit the first layout that offpolicy runs (docs/deploy.md, section 2; add your --config):", "",
                  "    " + sbatch(best, cluster)]
    lines += ["", sources(cal)]
    return "\n".join(lines)


def _overrides(e: Evaluation) -> list[str]:
    """The config overrides of a layout: the learner's parallelism and memory knobs, the servers' size."""
    lay, srv = e.candidate.learner, e.candidate.server
    mc = "learner.megatron"
    return ["learner.backend=megatron", f"{mc}.tp={lay.tp}", f"{mc}.pp={lay.pp}", f"{mc}.ep={lay.ep}",
            f"{mc}.etp={lay.etp}", f"{mc}.sequence_parallel={str(lay.sequence_parallel).lower()}",
            f"{mc}.recompute={lay.recompute}", f"{mc}.max_tokens_per_gpu={lay.max_tokens_per_gpu}",
            *([f"{mc}.optimizer_offload={lay.optimizer_offload:g}"] if lay.optimizer_offload else []),
            *([] if lay.grad_fp32 else [f"{mc}.grad_reduce_in_fp32=false"]),
            *([] if lay.pp_microbatches == "auto" else [f"{mc}.pp_microbatches={lay.pp_microbatches}"]),
            *_engine_overrides(srv), f"rollout.groups_per_lease={e.parts['groups_per_lease']}"]


def _load(p: dict) -> str:
    """The load cell: its seconds and kind; a staged load's read ahead and the swap after it."""
    if p.get("load_swap_s"):
        return f"{_n(p['load_s'])} ahead + {_n(p['load_swap_s'])} ({p['load_method']})"
    return f"{_n(p['load_s'])} ({p['load_method']})"


def _engine_overrides(srv) -> list[str]:
    stage = [f"rollout.{srv.engine}.prefetch={srv.stage}"] if srv.stage != "auto" else []
    if srv.engine == "vllm":
        return [f"rollout.vllm.tensor_parallel_size={srv.tp}",
                f"rollout.vllm.enable_expert_parallel={str(srv.ep > 1).lower()}",
                *([f"rollout.vllm.load_method={srv.load}"] if srv.load != "auto" else []), *stage]
    if srv.engine == "sglang":
        return [f"rollout.sglang.tp_size={srv.tp}", f"rollout.sglang.ep_size={srv.ep}", *stage]
    return []  # the torch engine: one GPU a daemon


def sbatch(e: Evaluation, cluster: Cluster) -> str:
    """The deploy/slurm/offpolicy.sbatch command line of a split layout (its overrides included)."""
    c, srv = e.candidate, e.candidate.server
    return (f"sbatch --nodes={cluster.nodes} --gpus-per-node={cluster.gpus_per_node} deploy/slurm/offpolicy.sbatch "
            f"--config run.yaml --learner-nodes {c.learner_nodes} --learner-tasks-per-node {cluster.gpus_per_node} "
            f"--gpus-per-server {srv.tp} " + " ".join(_overrides(e)))


def run_command(e: Evaluation, cluster: Cluster) -> str:
    """The `offpolicy run` command line of a layout that splits one node (`learner_gpus`): the learner on the first
    GPUs, a rollout daemon with its engine (an SGLang or vLLM server, or the torch engine) on each `server.tp` of
    the others."""
    c, tp = e.candidate, e.candidate.server.tp
    first = c.learner_gpus
    servers = [",".join(str(first + i * tp + g) for g in range(tp)) for i in range(c.shared_servers(cluster))]
    placed = [f"run.learner_gpus=[{','.join(str(g) for g in range(first))}]",
              "run.rollout_gpus=[" + ",".join(f'"{s}"' for s in servers) + "]", f"run.rollouts={len(servers)}",
              f"rollout.engine={c.server.engine}"]
    return "offpolicy run run.yaml " + " ".join(shlex.quote(o) for o in [*placed, *_overrides(e)])


def sources(cal: Calibration) -> str:
    """The calibration entries read, grouped by kind; the ones not measured here are spelled out."""
    used = sorted(cal.used)
    out = [f"Calibration ({cal.path or 'in memory'}): {len(used)} constants read."]
    for kind, title in (("public", "**Not measured here, public figures**"),
                        ("assumed", "**Not measured here, assumptions**")):
        names = [n for n in used if cal.entry(n).kind == kind]
        if names:
            out.append(f"{title}:")
            out += [f"- `{n}` = {cal.entry(n).value:g} {cal.entry(n).unit}: {cal.entry(n).source}" for n in names]
    measured = [n for n in used if cal.entry(n).kind in ("measured", "derived")]
    if measured:
        out.append("Measured here (docs/benchmarks.md): " + ", ".join(f"`{n}`" for n in measured) + ".")
    return "\n".join(out)


def plot(evals: list[Evaluation], cluster: Cluster, out: str | Path, top: int = 10) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [e for e in evals if e.runs][:top]
    if not shown:
        raise ValueError("no layout fits: nothing to plot")
    names = [f"#{i + 1}" for i in range(len(shown))]
    fig, (thr, parts) = plt.subplots(1, 2, figsize=(12, 0.45 * len(shown) + 2.8), dpi=120)
    y = range(len(shown))
    for s, off, color in ((0, -0.2, "tab:gray"), (1, 0.2, "tab:blue")):
        thr.barh([v + off for v in y], [e.runs[s]["tokens_per_s"] for e in shown], height=0.4, color=color,
                 label=f"max_staleness {s}")
    thr.set_yticks(list(y), names)
    thr.invert_yaxis()
    thr.set_xlabel("predicted tokens/s (responses)")
    thr.set_title("throughput per layout (ranked)")
    thr.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize=8)
    keys = [("train_s", "train"), ("stall_s", "stall"), ("publish_s", "publish"), ("relay_s", "relay"),
            ("load_s", "load")]
    left = [0.0] * len(shown)
    for key, label in keys:
        vals = [e.parts[key] for e in shown]
        parts.barh(list(y), vals, left=left, height=0.6, label=label)
        left = [a + b for a, b in zip(left, vals)]
    parts.barh(list(y), [e.runs[1]["lease_s"] for e in shown], left=left, height=0.6, label="lease (generation)")
    parts.set_yticks(list(y), names)
    parts.invert_yaxis()
    parts.set_xlabel("seconds per step and part")
    parts.set_title("part times (staleness 0 pays their sum)")
    parts.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=5, fontsize=8)
    for ax in (thr, parts):
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle(f"offpolicy plan: {cluster.nodes} x {cluster.gpus_per_node} {cluster.device.name}")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return Path(out)
