"""Predicted vs measured: the simulator against every pipeline run this project has recorded.

Each `Case` is a recorded run (docs/benchmarks.md names the section) rebuilt as a `PipelineModel`
whose part times come from the calibration, never from the run itself, except where a case says
`calibrated_on` (the CPU cases: their parts are measured at staleness 0, where nothing overlaps,
and staleness 1 and the other rollout counts are the predictions):
- GPU (`offpolicy bench pipeline`, 1, 2 and 4 GPUs): the torch engine's measured decode step
  (rollout benchmark) x 256 tokens, the learner's FLOPs at the measured Megatron MFU, the weight
  store's publish and load lines (weights benchmark), the hub's receive cost (transport benchmark);
  one GPU shared by learner and rollout is one processor-sharing resource;
- CPU (the quickstart shape on the 2-core VM, `benchmarks/plan_quickstart.py`): every daemon shares
  the cores with the other runnable tasks sampled during the run (`background`).
`table` prints measured and predicted tokens/s and the staleness 0 -> 1 speed-up side by side;
`learner_table` the learner's step time of the recorded Megatron layouts (learner alone): qwen3-moe-small
(Run 1, SequentialMLP experts) and, from `benchmarks/megatron_layouts.py` JSONs (`layout_runs`), any model
and layout, e.g. GPT-OSS-20B at full size (`layout_table`: step time, peak GPU memory and host memory).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from offpolicy.plan import costs
from offpolicy.plan.calibration import Calibration
from offpolicy.plan.hardware import DEVICES, Cluster
from offpolicy.plan.memory import GIB, LearnerLayout, learner_memory
from offpolicy.plan.shapes import Shape, from_config, load_shape
from offpolicy.plan.simulate import PipelineModel, ServerModel, simulate

PIPE = "docs/benchmarks.md, Pipeline: max_staleness 0 vs 1"
RUN1 = "docs/benchmarks.md, Four-GPU runs, Run 1"
# (label, gpus, tp, ep, measured step s, fitted): qwen3-moe-small, 16 x 8 x 512 tokens, bf16, H200, SequentialMLP
LEARNER_RUNS = [("1 GPU (4-GPU host)", 1, 1, 1, 0.740, True), ("TP4 + SP", 4, 4, 1, 0.628, False),
                ("TP2 x EP2 + SP", 4, 2, 2, 0.321, False), ("EP4", 4, 1, 4, 0.164, True),
                ("DP4", 4, 1, 1, 0.281, False),
                ("EP2 (2-GPU host)", 2, 1, 2, 0.377, False), ("DP2 (2-GPU host)", 2, 1, 1, 0.545, False),
                ("TP2 + SP (2-GPU host)", 2, 2, 1, 0.673, False)]
RUN2 = "docs/benchmarks.md, Four-GPU runs, Run 2"


@dataclass(frozen=True)
class Case:
    name: str
    source: str
    measured: dict[int, float]  # max_staleness -> tokens/s
    model: dict = field(default_factory=dict)  # how to rebuild it (see gpu_case / cpu_case)
    calibrated_on: str = ""  # which measured part times the case itself supplied

    def speedup(self) -> float:
        return self.measured[1] / self.measured[0]


def gpu_model(case: Case, staleness: int, cal: Calibration, own_parts: bool = False) -> PipelineModel:
    """`own_parts`: the run's own staleness-0 part times instead of the component benchmarks' (tests the
    simulation alone)."""
    m = case.model
    shape, dev = load_shape("bench-llama-110m"), DEVICES["h200"]
    rows, new, prompt = m["batch"] * m["n"], 256, 6
    tokens = rows * (prompt + new)
    if own_parts:
        gen, train, publish, load = m["parts0"]
    elif m["backend"] == "megatron":
        lay = LearnerLayout(m["learner_gpus"], tp=m["learner_gpus"], max_tokens_per_gpu=16384)
        train = costs.learner_step(shape, lay, Cluster(1, 8, dev), cal, tokens, prompt + new)["total"]
        publish = costs.gathered_publish(shape, lay, cal, "sha256")["total"]
    else:  # the torch learner: one GPU at the measured Megatron MFU (its own MFU was not measured apart)
        lay = LearnerLayout(1, max_tokens_per_gpu=16384)
        train = costs.learner_step(shape, lay, Cluster(1, 8, dev), cal, tokens, prompt + new)["total"]
        publish = costs.gathered_publish(shape, None, cal, "sha256")["total"]
    if not own_parts:
        gen = cal.get("torch_engine.static.step_s") * new
        load = cal.get("weights.load.staged.fixed_s") + shape.version_bytes() / (cal.get("weights.load.staged.gbps")
                                                                                   * 1e9)

    def lease(rng, groups):
        return gen, [m["n"] * new] * groups

    shared = m.get("shared", False)
    names = ["gpu0"] if shared else [f"r{i}" for i in range(m["rollouts"])]
    servers = tuple(ServerModel(lease, names[0] if shared else names[i], 0, load) for i in range(m["rollouts"]))
    resources = {n: 1.0 for n in names} | ({} if shared else {"learner": 1.0})
    return PipelineModel(m["batch"], staleness, servers, lambda t: train, publish, resources,
                         ("gpu0",) if shared else ("learner",), groups_per_lease=m["batch"],
                         hub_s_per_group=cal.get("hub.group_s"), overlap_publish=False)  # before the sharded publish


def cpu_model(case: Case, staleness: int, cal: Calibration, own_parts: bool = False) -> PipelineModel:
    """Parts at full speed: the staleness-0 calibration run's times x its speed on the shared cores
    (at staleness 0 one of our processes runs at a time: speed min(1, cores / (1 + background)))."""
    m, c = case.model, case.model["calibration"]
    speed = min(1.0, m["cores"] / (1 + c["background"]))
    gen, train = c["gen_s"] * speed, c["train_s"] * speed

    def lease(rng, groups):
        return gen, [m["tokens_per_group"]] * groups

    servers = tuple(ServerModel(lease, "cpu", 0, c["load_s"]) for _ in range(m["rollouts"]))
    return PipelineModel(m["batch"], staleness, servers, lambda t: train, c["publish_s"], {"cpu": float(m["cores"])},
                         ("cpu",), groups_per_lease=m["lease"], background={"cpu": m["background"][staleness]},
                         overlap_publish=False)  # these runs: before the sharded publish


def predict(case: Case, cal: Calibration, own_parts: bool = False, steps: int = 40,
            warmup: int = 8) -> dict[int, dict[str, float]]:
    build = gpu_model if case.model.get("kind") == "gpu" else cpu_model
    return {s: simulate(build(case, s, cal, own_parts), steps).summary(warmup) for s in case.measured}


def gpu_cases() -> list[Case]:
    def gpu(name, source, s0, s1, parts0, **model):  # parts0: the staleness-0 row's T_gen, T_train, T_publish, T_load
        return Case(name, source, {0: s0, 1: s1}, {"kind": "gpu", "batch": 8, "n": 8, "rollouts": 1,
                                                  "backend": "torch", "learner_gpus": 1, "parts0": parts0, **model})
    return [
        gpu("1 GPU shared: torch learner + 1 rollout", PIPE + " (GPU rows)", 20976, 30170, (.450, .088, .194, .040),
            shared=True),
        gpu("2 GPUs: torch learner + 1 rollout", RUN2 + " (2-GPU table)", 19223, 30952, (.501, .089, .223, .030)),
        gpu("2 GPUs: megatron learner + 1 rollout", RUN2 + " (2-GPU table)", 17549, 30119, (.502, .138, .242, .039),
            backend="megatron"),
        gpu("4 GPUs: megatron TP2 learner + 2 rollouts", RUN2 + " (four GPUs)", 18720, 38086, (.496, .103, .224, .048),
            backend="megatron", learner_gpus=2, rollouts=2),
        gpu("4 GPUs: torch learner + 2 rollouts", RUN2 + " (four GPUs)", 20686, 40315, (.495, .163, .155, .049),
            rollouts=2),
    ]


def cpu_pipeline_case() -> Case:
    """The recorded CPU pipeline row (2 layers, hidden 64): its staleness-0 parts predict staleness 1.
    Its background was not recorded; the VM's other load is taken as 0. Tokens per group: the
    staleness-0 row's tokens/s x T_step / 8 groups (responses stop at EOS before 32 tokens)."""
    cal = {"background": 0.0, "gen_s": 0.056, "train_s": 0.048, "publish_s": 0.003, "load_s": 0.003}
    return Case("CPU pipeline, tiny model, 1 rollout", PIPE + " (CPU rows)", {0: 11461, 1: 21347},
                {"kind": "cpu", "cores": 2, "rollouts": 1, "batch": 8, "lease": 8, "tokens_per_group": 11461 * .116 / 8,
                 "calibration": cal, "background": {0: 0.0, 1: 0.0}},
                calibrated_on="its own staleness-0 row (T_gen, T_train, T_publish, T_load)")


def quickstart_cases(path: str | Path) -> list[Case]:
    """The runs of benchmarks/plan_quickstart.py: one case per repeat and rollout count (its staleness
    0 and 1 runs), each predicted with the background sampled in that run and the parts of the
    calibration run made just before it (the same repeat)."""
    doc = json.loads(Path(path).read_text())
    cals = {c.get("repeat", 0): c for c in doc.get("calibrations") or [doc["calibration"]]}
    runs: dict[tuple[int, int], dict[int, dict]] = {}
    for r in doc["runs"]:
        runs.setdefault((r.get("repeat", 0), r["rollouts"]), {})[r["max_staleness"]] = r
    out = []
    for (rep, n), by_s in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if set(by_s) != {0, 1}:
            continue
        out.append(Case(f"CPU quickstart, {n} rollout{'s' if n > 1 else ''}, run {rep + 1}",
                        "docs/benchmarks.md, Planner validation runs", {s: by_s[s]["tokens_per_s"] for s in (0, 1)},
                        {"kind": "cpu", "cores": doc.get("cores", 2), "rollouts": n, "batch": 16, "lease": 8,
                         "tokens_per_group": by_s[0]["tokens_per_step"] / 16, "calibration": cals[rep],
                         "background": {s: by_s[s]["background"] for s in (0, 1)}},
                        calibrated_on="the bench pipeline staleness-0 run with 1 rollout made before it"))
    return out


def learner_rows(cal: Calibration) -> list[dict]:
    """Predicted vs measured Megatron steps of the recorded layouts (`fitted`: a calibration point)."""
    shape, cluster = load_shape("qwen3-moe-small"), Cluster(1, 8, DEVICES["h200"])
    out = []
    for label, gpus, tp, ep, measured, fitted in LEARNER_RUNS:
        lay = LearnerLayout(gpus, tp=tp, ep=ep, experts="sequential")
        pred = costs.learner_step(shape, lay, cluster, cal, 16 * 8 * 512, 512)["total"]
        out.append({"layout": label, "measured": measured, "predicted": pred, "error": pred / measured - 1,
                    "fitted": fitted})
    return out


def learner_table(results: list[dict]) -> str:
    lines = [f"Megatron learner alone, qwen3-moe-small ({RUN1}):", "",
             "| layout | measured step s | predicted step s | error |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['layout']} | {r['measured']:.3f} | {r['predicted']:.3f} | "
              + ("fitted" if r["fitted"] else f"{r['error']:+.1%}") + " |" for r in results]
    return "\n".join(lines)


def rows(cases: list[Case], cal: Calibration) -> list[dict]:
    out = []
    for case in cases:
        pred = predict(case, cal)
        sp = pred[0]["step_s"] / pred[1]["step_s"]
        row = {"case": case.name, "source": case.source, "calibrated_on": case.calibrated_on,
               "measured": case.measured, "predicted": {s: pred[s]["tokens_per_s"] for s in pred},
               "measured_speedup": case.speedup(), "predicted_speedup": sp,
               "error": {s: pred[s]["tokens_per_s"] / case.measured[s] - 1 for s in pred},
               "speedup_error": sp / case.speedup() - 1}
        if "parts0" in case.model:
            own = predict(case, cal, own_parts=True)
            row["own_parts"] = {"predicted": {s: own[s]["tokens_per_s"] for s in own},
                                "speedup": own[0]["step_s"] / own[1]["step_s"]}
        out.append(row)
    return out


def table(results: list[dict]) -> str:
    lines = ["| run | measured tokens/s s=0 / s=1 | predicted s=0 / s=1 (error) | speed-up measured / predicted "
             "(error) | simulation alone: s=1 tokens/s, speed-up (error) | source |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        m, p, e = r["measured"], r["predicted"], r["error"]
        own = r.get("own_parts")
        alone = "-"
        if own:
            alone = (f"{own['predicted'][1]:,.0f} ({own['predicted'][1] / m[1] - 1:+.1%}), {own['speedup']:.2f}x "
                     f"({own['speedup'] / r['measured_speedup'] - 1:+.1%})")
        lines.append(f"| {r['case']} | {m[0]:,.0f} / {m[1]:,.0f} | {p[0]:,.0f} ({e[0]:+.1%}) / {p[1]:,.0f} "
                     f"({e[1]:+.1%}) | {r['measured_speedup']:.2f}x / {r['predicted_speedup']:.2f}x "
                     f"({r['speedup_error']:+.1%}) | {alone} | {r['source']}"
                     + (f"; parts from {r['calibrated_on']}" if r["calibrated_on"] else "") + " |")
    worst = max(max(abs(v) for v in r["error"].values()) for r in results)
    worst_sp = max(abs(r["speedup_error"]) for r in results)
    lines.append(f"\nlargest error: tokens/s {worst:.1%}, speed-up {worst_sp:.1%}")
    return "\n".join(lines)


FULL = "docs/megatron.md, GPT-OSS-20B at full size"
# the node's host memory peak of a run (benchmarks/gptoss20b_gpu4.sh samples it; the JSON holds each rank's state only)
NODE_HOST_PEAK_GIB = {"gptoss20b-offload": 333.0}


@dataclass(frozen=True)
class LayoutRun:
    """One layout of a `benchmarks/megatron_layouts.py` run: what ran and what it measured."""
    label: str
    source: str
    config: dict  # the model's HF config.json
    device: str  # a hardware preset (h100, h200)
    gpus: int
    tp: int
    ep: int
    pp: int
    etp: int
    offload: float
    grad_fp32: bool
    tokens: int  # tokens of a step
    seq: int  # tokens of a sequence (prompt + response)
    max_tokens: int  # the micro-batch budget (max_tokens_per_gpu)
    step_s: float
    peak_gib: float  # torch.cuda.max_memory_allocated, the largest rank's
    host_gib: float | None = None  # the node's host memory peak, where recorded

    def layout(self) -> LearnerLayout:
        return LearnerLayout(self.gpus, tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp,
                             max_tokens_per_gpu=self.max_tokens, optimizer_offload=self.offload,
                             grad_fp32=self.grad_fp32)


def layout_runs(path: str | Path, source: str = FULL) -> list[LayoutRun]:
    """The layouts of one `benchmarks/megatron_layouts.py --model DIR` JSON (bf16, one node)."""
    doc = json.loads(Path(path).read_text())
    if doc.get("bench") != "megatron_layouts" or not doc.get("hf_config"):
        raise ValueError(f"{path}: not a benchmarks/megatron_layouts.py --model JSON (bench, hf_config)")
    b, cmd = doc["batch"], doc.get("command", "")
    out = []
    for lay in doc["layouts"]:
        dev = next((k for k in DEVICES if k.upper() in lay.get("device", "").upper()), "h200")
        out.append(LayoutRun(f"{Path(path).stem} {lay['name']}", f"{source} ({Path(path).name})", doc["hf_config"], dev,
                             lay["world"], lay["tp"], lay["ep"], lay["pp"], lay.get("etp", 1), lay.get("offload", 0.0),
                             "grad_reduce_in_fp32=false" not in cmd, lay["tokens_per_step"],
                             b["prompt"] + b["response"], b["max_tokens"], lay["step_s"], lay["peak_mem_gib"],
                             NODE_HOST_PEAK_GIB.get(Path(path).stem) if lay.get("offload") else None))
    return out


def predict_layout(shape: Shape, lay: LearnerLayout, device: str, tokens: int, seq: int, cal: Calibration,
                   host_cores: int = 64) -> dict:
    """The planner's figures of a learner layout alone on one node of its GPUs (`device` a preset: h100, h200):
    step seconds (and its parts), peak GPU GiB of the busiest GPU (and its parts), the node's host GiB (the host
    optimizer's state; no weight versions), and why the layout cannot run the model (None if it can)."""
    cluster = Cluster(1, lay.gpus, DEVICES[device], host_cores=host_cores)
    step = costs.learner_step(shape, lay, cluster, cal, tokens, seq)
    mem = learner_memory(shape, lay, seq, tokens // lay.dp)
    return {"step": step, "predicted_s": step["total"], "predicted_gib": mem.total / GIB, "memory_gib": mem.gib(),
            "predicted_host_gib": mem.host * min(lay.gpus, cluster.gpus_per_node) / GIB, "problem": lay.check(shape)}


def layout_rows(runs: list[LayoutRun], cal: Calibration, host_cores: int = 64) -> list[dict]:
    """Predicted vs measured step time, peak GPU memory and the node's host memory (the host optimizer's state;
    these runs published no versions) of each run, on one node of `run.gpus` GPUs with `host_cores` cores."""
    out = []
    for r in runs:
        pred = predict_layout(from_config(r.label, r.config), r.layout(), r.device, r.tokens, r.seq, cal, host_cores)
        out.append({"run": r.label, "source": r.source, "step": pred["step"], "predicted_s": pred["predicted_s"],
                    "measured_s": r.step_s, "predicted_gib": pred["predicted_gib"], "measured_gib": r.peak_gib,
                    "predicted_host_gib": pred["predicted_host_gib"], "measured_host_gib": r.host_gib})
    return out


def layout_table(rows: list[dict]) -> str:
    lines = ["| run | predicted step s | measured | ratio | predicted peak GiB | measured | ratio | predicted host GiB "
             "| measured |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        host = f"{r['measured_host_gib']:.0f}" if r["measured_host_gib"] is not None else "-"
        lines.append(f"| {r['run']} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | "
                     f"{r['predicted_s'] / r['measured_s']:.2f} | {r['predicted_gib']:.1f} | {r['measured_gib']:.1f} | "
                     f"{r['predicted_gib'] / r['measured_gib']:.2f} | {r['predicted_host_gib']:.0f} | {host} |")
    return "\n".join(lines)


FULL_SIZE_JSONS = ("gptoss20b-mxfp4.json", "gptoss20b-device.json", "gptoss20b-offload.json")
FULL_SIZE_LABELS = {"gptoss20b-mxfp4 ep4": "EP4, optimizer on the GPUs (run with the MXFP4 publish)",
                    "gptoss20b-device tp2ep2": "TP2 x EP2, optimizer on the GPUs",
                    "gptoss20b-offload ep4": "EP4, optimizer on the host",
                    "gptoss20b-offload tp2ep2": "TP2 x EP2, optimizer on the host"}


def full_size_runs(directory: str | Path) -> list[LayoutRun]:
    """GPT-OSS-20B at full size on 4 x H200 (docs/megatron.md): the layouts of the three JSONs in `directory`
    (benchmarks/results/) and the EP4 run the docs' table records (1.216 s, 113.0 GiB; its JSON was not kept:
    the same command as the MXFP4 run without weights.formats)."""
    runs = [r for name in FULL_SIZE_JSONS for r in layout_runs(Path(directory) / name)]
    runs = [replace(r, label=FULL_SIZE_LABELS.get(r.label, r.label)) for r in runs]
    ep4 = runs[0]
    docs = replace(ep4, label="EP4, optimizer on the GPUs", source=f"{FULL} (the table)", step_s=1.216, peak_gib=113.0)
    return [docs, *runs]
