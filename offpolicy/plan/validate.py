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
`learner_table` the learner's step time of the recorded Megatron layouts (learner alone).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from offpolicy.plan import costs
from offpolicy.plan.calibration import Calibration
from offpolicy.plan.hardware import DEVICES, Cluster
from offpolicy.plan.memory import LearnerLayout
from offpolicy.plan.shapes import load_shape
from offpolicy.plan.simulate import PipelineModel, ServerModel, simulate

PIPE = "docs/benchmarks.md, Pipeline: max_staleness 0 vs 1"
RUN1 = "docs/benchmarks.md, Four-GPU runs, Run 1"
# (label, gpus, tp, ep, measured step s, fitted): qwen3-moe-small, 16 x 8 x 512 tokens, bf16, H200
LEARNER_RUNS = [("1 GPU (4-GPU host)", 1, 1, 1, 0.740, True), ("TP4 + SP", 4, 4, 1, 0.628, False),
                ("TP2 x EP2 + SP", 4, 2, 2, 0.321, False), ("EP4", 4, 1, 4, 0.164, True), ("DP4", 4, 1, 1, 0.281, False),
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
        publish = costs.publish_parts(shape, lay, cal, "sha256")["total"]
    else:  # the torch learner: one GPU at the measured Megatron MFU (its own MFU was not measured apart)
        lay = LearnerLayout(1, max_tokens_per_gpu=16384)
        train = costs.learner_step(shape, lay, Cluster(1, 8, dev), cal, tokens, prompt + new)["total"]
        publish = costs.publish_parts(shape, None, cal, "sha256")["total"]
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
                         hub_s_per_group=cal.get("hub.group_s"))


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
                         ("cpu",), groups_per_lease=m["lease"], background={"cpu": m["background"][staleness]})


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
    """The runs of benchmarks/plan_quickstart.py, one case per rollout count: medians over its
    repeats of tokens/s and background, parts from the median calibration run."""
    doc = json.loads(Path(path).read_text())
    cals = doc.get("calibrations") or [doc["calibration"]]
    cal = {k: statistics.median(c[k] for c in cals) for k in ("background", "gen_s", "train_s", "publish_s", "load_s")}
    runs: dict[int, dict[int, list[dict]]] = {}
    for r in doc["runs"]:
        runs.setdefault(r["rollouts"], {}).setdefault(r["max_staleness"], []).append(r)
    out = []
    for n, by_s in sorted(runs.items()):
        if set(by_s) != {0, 1}:
            continue
        med = {s: {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "background", "tokens_per_step")}
               for s, rs in by_s.items()}
        reps = len(by_s[0])
        out.append(Case(f"CPU quickstart, {n} rollout{'s' if n > 1 else ''} (median of {reps})",
                        "docs/benchmarks.md, Planner validation runs",
                        {s: med[s]["tokens_per_s"] for s in (0, 1)},
                        {"kind": "cpu", "cores": doc.get("cores", 2), "rollouts": n, "batch": 16, "lease": 8,
                         "tokens_per_group": med[0]["tokens_per_step"] / 16, "calibration": cal,
                         "background": {s: med[s]["background"] for s in (0, 1)}},
                        calibrated_on=f"the bench pipeline staleness-0 run with 1 rollout (median of {len(cals)})"))
    return out


def learner_rows(cal: Calibration) -> list[dict]:
    """Predicted vs measured Megatron steps of the recorded layouts (`fitted`: a calibration point)."""
    shape, cluster = load_shape("qwen3-moe-small"), Cluster(1, 8, DEVICES["h200"])
    out = []
    for label, gpus, tp, ep, measured, fitted in LEARNER_RUNS:
        pred = costs.learner_step(shape, LearnerLayout(gpus, tp=tp, ep=ep), cluster, cal, 16 * 8 * 512, 512)["total"]
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
