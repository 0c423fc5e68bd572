"""The recorded runs the weight-version model (versions.py) is calibrated against, rebuilt and predicted.

`PUBLISHES`: the sharded publish of one learner layout (benchmarks/publish.py, benchmarks/megatron_layouts.py
--publish): the write's seconds, the learner's stall per version, and the step while a version is written, each
predicted from the calibration (the step alone is the run's own). `PIPELINES`: `offpolicy bench pipeline` runs
at max_staleness 0 and 1, rebuilt as a `PipelineModel` whose generation (the staleness-0 row's seconds of one
generate call) and training (its T_train) are the run's own, and whose publish, stall, slowdown and load come
from versions.py: the cases test how the product's publish and load sit on (or off) the pipeline's critical
path. Short runs (the eleventh and tenth sessions: 6-8 steps) are inside the first versions.FRESH_VERSIONS and
are predicted with the fresh-page rates; the 18-step runs of the third session are at steady state. Which
constants a row was fitted on is said in `fitted` (calibration.yaml gives the arithmetic). `gathered` rebuilds
the same cases with the model the planner had before (the gathered publish on the learner's path, the staged
load as a stall): tests/unit/test_plan_publish.py shows it misses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from offpolicy.learner.backends.megatron.memory import gpt_oss_slice
from offpolicy.plan import costs, versions
from offpolicy.plan.calibration import Calibration
from offpolicy.plan.hardware import DEVICES, Cluster
from offpolicy.plan.memory import LearnerLayout, RolloutServerSpec
from offpolicy.plan.shapes import Shape, from_config, load_shape
from offpolicy.plan.simulate import PipelineModel, ServerModel, simulate

B = "docs/benchmarks.md"
DENSE_12B = dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                 num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096,
                 tie_word_embeddings=True)  # gptoss_gpu4.sh dense / dense-long: 1.14 B parameters, 2.28 GB a version


def shape_of(name: str) -> Shape:
    if name == "gptoss-slice":
        return from_config(name, gpt_oss_slice(2))
    if name == "dense-1.2b":
        return from_config(name, DENSE_12B)
    return load_shape(name)


@dataclass(frozen=True)
class Publish:
    label: str
    source: str
    model: str
    device: str
    gpus: int
    tp: int
    ep: int
    expert_bits: float
    step_s: float  # the train step alone
    publish_s: float  # one version written (steady state)
    stall_s: float | None  # the learner's stall per version (None: not comparable, see `note`)
    writing_s: float  # the step while the previous version is written
    fitted: str = ""
    note: str = ""


S12, SS, FULL = (f"{B}, One H200, twelfth session", f"{B}, Sharded publish (issue 32), steady state (4 x H200)",
                 "docs/megatron.md, GPT-OSS-20B at full size (4 x H200)")
H100 = f"{B}, Sharded publish (issue 32), 4 x H100"
PUBLISHES = [
    Publish("slice, 1 GPU, bf16", S12, "gptoss-slice", "h200", 1, 1, 1, 16, 0.657, 0.126, 0.019, 0.727,
            "gpu_gbps, publish_slowdown"),
    Publish("slice, 1 GPU, MXFP4", S12, "gptoss-slice", "h200", 1, 1, 1, 4.25, 0.654, 0.092, 0.026, 0.687,
            "encode_gbps (with the full-size MXFP4 row)"),
    Publish("slice, 1 GPU, bf16 (steady-state table)", SS, "gptoss-slice", "h200", 1, 1, 1, 16, 0.770, 0.131,
            0.027 * 0.770, 0.770 * 1.09),
    Publish("slice, EP2", SS, "gptoss-slice", "h200", 2, 1, 2, 16, 0.411, 0.084, 0.029 * 0.411, 0.411 * 1.12),
    Publish("slice, EP4", SS, "gptoss-slice", "h200", 4, 1, 4, 16, 0.233, 0.067, 0.035 * 0.233, 0.233 * 1.14),
    Publish("gpt-oss-20b, EP4, bf16", FULL, "gpt-oss-20b", "h200", 4, 1, 4, 16, 1.216, 0.532, 0.051 * 1.216,
            1.216 * 1.32, "node_gbps"),
    Publish("gpt-oss-20b, EP4, MXFP4", FULL, "gpt-oss-20b", "h200", 4, 1, 4, 4.25, 1.137, 0.253, None,
            1.137 * 1.07885, "encode_gbps (with the slice's MXFP4 row)",
            "stall 0.095 s measured before the event-based begin (12th session): not comparable"),
    Publish("gpt-oss-20b, TP2 x EP2, bf16", FULL, "gpt-oss-20b", "h200", 4, 2, 2, 16, 1.716, 0.372, 0.055,
            1.716 * 1.2926, note="another call: 112.6 GB/s for the node, the planner's 80 is 40 % slow"),
    Publish("slice, 1 GPU, bf16 (H100, host busy)", H100 + " (d6e9900)", "gptoss-slice", "h100", 1, 1, 1, 16, 0.819,
            0.159, 0.032 * 0.819, 0.819 * 1.09),
    Publish("slice, EP2 (H100)", H100 + " (d6e9900)", "gptoss-slice", "h100", 2, 1, 2, 16, 0.442, 0.091,
            0.043 * 0.442, 0.442 * 1.12),
    Publish("slice, EP2 (H100, 39564cf)", H100 + " (39564cf)", "gptoss-slice", "h100", 2, 1, 2, 16, 0.443, 0.080,
            0.029 * 0.443, 0.443 * 1.08),
]


def publish_rows(cal: Calibration, runs: list[Publish] = PUBLISHES) -> list[dict]:
    out = []
    for r in runs:
        lay = LearnerLayout(r.gpus, tp=r.tp, ep=r.ep)
        pub = versions.publish(shape_of(r.model), lay, Cluster(1, max(4, r.gpus), DEVICES[r.device]), cal, "fast",
                               r.expert_bits)
        writing = versions.slowed_train_s(r.step_s, pub["write"], cal.get("learner.publish_slowdown"))
        out.append({"run": r.label, "source": r.source, "fitted": r.fitted, "note": r.note,
                    "publish": (pub["write"], r.publish_s), "stall": (pub["stall"], r.stall_s),
                    "writing": (writing, r.writing_s)})
    return out


@dataclass(frozen=True)
class Pipeline:
    label: str
    source: str
    model: str
    device: str
    learner: LearnerLayout
    server: RolloutServerSpec
    rollouts: int
    batch: int  # groups a step
    lease: int  # groups a lease
    gen_s: float  # one generate call (the staleness-0 row's T_gen)
    train_s: float  # the staleness-0 row's T_train
    measured: dict[int, float] = field(default_factory=dict)  # max_staleness -> T_step
    parts: tuple[float, float] = (0.0, 0.0)  # T_publish, T_load measured (the mean of the two rows)
    fresh: bool = False  # a short run: every version in fresh pages
    fitted: str = ""


E11 = f"{B}, The 2 + 2 GPT-OSS slice pipeline (eleventh session, 4 x H200)"
PIPELINES = [
    Pipeline("slice 2 + 2, torch engine, bf16", E11, "gptoss-slice", "h200", LearnerLayout(2, ep=2),
             RolloutServerSpec("torch"), 2, 64, 64, 0.372, 0.179, {0: 1.839, 1: 1.005}, ((0.783 + 0.749) / 2,
             (0.434 + 0.448) / 2), fresh=True),
    Pipeline("slice 2 + 2, vLLM, bf16", E11, "gptoss-slice", "h200", LearnerLayout(2, ep=2),
             RolloutServerSpec("vllm", load="rebuild"), 2, 64, 64, 1.567, 0.158, {0: 4.942, 1: 2.696},
             ((0.841 + 0.892) / 2, (2.560 + 2.856) / 2), fresh=True,
             fitted="vllm.load.rebuild_gbps (its T_load)"),
    Pipeline("gpt-oss-20b 2 + 2, vLLM, MXFP4", f"{B}, GPT-OSS-20B at full size (tenth session, 4 x H200)",
             "gpt-oss-20b", "h200", LearnerLayout(2, ep=2, optimizer_offload=1.0, grad_fp32=False),
             RolloutServerSpec("vllm", expert_bits=4.25, load="rebuild"), 2, 16, 16, 3.502, 11.889,
             {0: 28.055, 1: 15.894}, ((2.165 + 3.351) / 2, (10.078 + 12.921) / 2), fresh=True,
             fitted="vllm.load.rebuild_mxfp4_gbps (its T_load)"),
    Pipeline("slice 1 + 1, torch engine, steady state", f"{B}, The balanced pipelines at steady state (4 x H200)",
             "gptoss-slice", "h200", LearnerLayout(1), RolloutServerSpec("torch"), 1, 32, 32, 1.341, 0.610,
             {0: 2.178, 1: 1.417}, ((0.129 + 0.128) / 2, (0.105 + 0.104) / 2)),
    Pipeline("slice 1 + 1, torch engine, steady state (H100)", f"{B}, The GPT-OSS slice, balanced (4 x H100)",
             "gptoss-slice", "h100", LearnerLayout(1), RolloutServerSpec("torch"), 1, 32, 32, 1.158, 0.807,
             {0: 2.278, 1: 1.273}, ((0.150 + 0.147) / 2, (0.112 + 0.107) / 2)),
    Pipeline("1.2B dense 1 + 1, torch engine, steady state", f"{B}, The balanced pipelines at steady state (4 x H200)",
             "dense-1.2b", "h200", LearnerLayout(1), RolloutServerSpec("torch"), 1, 32, 32, 3.580, 2.941,
             {0: 6.679, 1: 3.702}, ((0.057 + 0.058) / 2, 0.048)),
]
# the third session's runs had no double buffer yet (rollout.double_buffer came with issue 48): their loads stalled
NO_DOUBLE_BUFFER = {"slice 1 + 1, torch engine, steady state", "slice 1 + 1, torch engine, steady state (H100)",
                    "1.2B dense 1 + 1, torch engine, steady state"}


def pipeline_model(run: Pipeline, staleness: int, cal: Calibration, gathered: bool = False) -> PipelineModel:
    """The run as the planner's simulation sees it: today's publish and loads, or (`gathered`) the model before."""
    shape = shape_of(run.model)
    cluster = Cluster(1, 4, DEVICES[run.device])

    def lease(rng, groups):
        return run.gen_s, [256] * groups

    names = [f"r{i}" for i in range(run.rollouts)]
    res = {n: 1.0 for n in names} | {"learner": 1.0}
    common = dict(batch_groups=run.batch, max_staleness=staleness, train_s=lambda t: run.train_s, resources=res,
                  learner_resources=("learner",), groups_per_lease=run.lease, hub_s_per_group=cal.get("hub.group_s"))
    if gathered:  # the planner before: the gather + sha256 write on the learner's path, the staged load a stall
        pub = costs.gathered_publish(shape, run.learner, cal, "sha256")["total"]
        load = costs.staged_load_s(shape, run.server, cal)
        servers = tuple(ServerModel(lease, n, 0, load) for n in names)
        return PipelineModel(servers=servers, publish_s=pub, overlap_publish=False, **common)
    pub = versions.publish(shape, run.learner, cluster, cal, "fast", run.server.expert_bits)
    ld = versions.load(shape, run.server, cal)
    prefetch = bool(ld["background"]) and run.label not in NO_DOUBLE_BUFFER
    servers = tuple(ServerModel(lease, n, 0, ld["seconds"], prefetch, ld["fresh"]) for n in names)
    return PipelineModel(servers=servers, publish_s=pub["write"], stall_s=pub["stall"],
                         slowdown=cal.get("learner.publish_slowdown"),
                         fresh_versions=versions.FRESH_VERSIONS if run.fresh else 0, fresh_publish_s=pub["fresh"],
                         **common)


def pipeline_rows(cal: Calibration, runs: list[Pipeline] = PIPELINES, gathered: bool = False, steps: int = 9,
                  warmup: int = 3) -> list[dict]:
    """Predicted T_step per staleness and the speed-up against the measured ones. The short runs averaged steps
    2-7 of 7-8; the simulation's window (`warmup` .. `steps`) stays inside their fresh versions too."""
    out = []
    for r in runs:
        pred = {s: simulate(pipeline_model(r, s, cal, gathered), steps).summary(warmup, s + 1)["step_s"] for s in r.measured}
        m = pipeline_model(r, 0, cal, gathered)
        fresh = m.fresh_versions > 0  # the parts of the versions the window saw
        parts = (m.publish_of(0 if fresh else m.fresh_versions), m.servers[0].load_of(0 if fresh else 1, m.fresh_versions))
        out.append({"run": r.label, "source": r.source, "fitted": r.fitted, "predicted": pred, "measured": r.measured,
                    "speedup": (pred[0] / pred[1], r.measured[0] / r.measured[1]),
                    "publish": (parts[0], r.parts[0]), "load": (parts[1], r.parts[1])})
    return out


def table(publishes: list[dict], pipelines: list[dict]) -> str:
    def pm(p, m):
        return "-" if m is None else f"{p:.3f} / {m:.3f} ({p / m - 1:+.0%})"

    lines = ["Sharded publish, predicted / measured s (error):", "",
             "| run | write | learner stall | step while writing | fitted on it |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['run']} | {pm(*r['publish'])} | {pm(*r['stall'])} | {pm(*r['writing'])} | "
              + "; ".join(x for x in (r["fitted"], r["note"]) if x) + " |" for r in publishes]
    lines += ["", "Pipelines, T_step predicted / measured s (error):", "",
              "| run | staleness 0 | staleness 1 | speed-up | T_publish | T_load | fitted on it |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in pipelines:
        p, m = r["predicted"], r["measured"]
        sp = r["speedup"]
        lines.append(f"| {r['run']} | {pm(p[0], m[0])} | {pm(p[1], m[1])} | {sp[0]:.2f}x / {sp[1]:.2f}x | "
                     f"{pm(*r['publish'])} | {pm(*r['load'])} | {r['fitted']} |")
    return "\n".join(lines)
