"""benchmarks/megatron_layouts.py's layouts for 8 GPUs (issue 51): `edpN` names the expert-data-parallel replicas,
the planner's expectation of each layout is printed before it runs and beside what it measured, and `--dry` prints
the torchrun commands and runs nothing (no torch worker starts: this runs on the CPU in a second)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import ROOT

BENCH = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def layouts():
    sys.path.insert(0, str(BENCH))  # layouts_table, beside the script (as when it runs)
    try:
        spec = importlib.util.spec_from_file_location("megatron_layouts_under_test", BENCH / "megatron_layouts.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("name,gpus,want", [
    ("ep8", 8, (8, 1, 8, 8, 1)), ("ep4edp2", 8, (8, 1, 4, 8, 2)), ("ep4dp4", 8, (4, 1, 4, 4, 1)),
    ("ep4", 8, (8, 1, 4, 8, 2)), ("ep2edp2", 1, (4, 1, 2, 4, 2)), ("tp2ep2edp2", 8, (4, 2, 2, 2, 2)),
    ("ep4x_edp2", 2, (8, 1, 4, 8, 2)), ("1", 8, (1, 1, 1, 1, 1))])
def test_layout_names_give_world_and_the_expert_data_parallel_replicas(layouts, name, gpus, want):
    lay = layouts.parse_layout(name, gpus)
    assert (lay["world"], lay["tp"], lay["ep"], lay["dp"], lay["edp"]) == want


@pytest.mark.parametrize("name", ["ep4edp2dp2", "ep3", "ep4edp", "ep4edp0"])
def test_layouts_that_do_not_add_up_are_refused(layouts, name):
    with pytest.raises(SystemExit, match="layout"):
        layouts.parse_layout(name, 8)


def test_dry_prints_the_expectation_and_each_command_and_runs_nothing(layouts, capsys):
    rc = layouts.main(["--dry", "--arch", "gptoss-20b", "--gpus", "8", "--layouts", "ep4dp4", "ep8", "ep4edp2",
                       "--groups", "16", "--samples", "8", "--prompt", "128", "--response", "384", "--max-tokens",
                       "8192", "--set", "learner.megatron.grad_reduce_in_fp32=false"])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = [x for x in out.splitlines() if x.startswith("expected (offpolicy plan, h200): ")]
    assert [x.split(": ", 1)[1].split(" (")[0] for x in lines] == ["ep4dp4", "ep8", "ep4edp2"]
    # the planner's figures (tests/unit/test_plan_one_node.py pins them): EP8 and EP4 x DP2 halve EP4's optimizer
    assert "step 1.175 s, peak 111.6 GiB" in lines[0] and "step 0.601 s, peak 73.5 GiB" in lines[1]
    assert "edp 2): step 0.617 s, peak 82.4 GiB" in lines[2] and "OVER" not in out
    commands = [x for x in out.splitlines() if x.startswith("== layout ")]
    assert [c.split("--nproc-per-node ")[1].split()[0] for c in commands] == ["4", "8", "8"]
    assert commands[2].endswith("--tp=1 --pp=1 --ep=4 --etp=1") and "--arch gptoss-20b" in commands[2]


def test_dry_flags_a_layout_the_planner_says_cannot_run_or_fit(layouts, capsys):
    # 8 KV heads: tp 16 cannot split them; EP2 on 2 H100s holds over 80 GiB
    assert layouts.main(["--dry", "--arch", "gptoss-20b", "--gpus", "16", "--layouts", "tp16"]) == 2
    assert "no expectation (tp 16 does not divide" in capsys.readouterr().out
    assert layouts.main(["--dry", "--arch", "gptoss-20b", "--plan-gpu", "h100", "--layouts", "ep2"]) == 0
    assert "OVER the GPU's 79.6 GiB" in capsys.readouterr().out


def test_the_table_shows_edp_and_the_planner_beside_the_measurement(layouts):
    from layouts_table import compare, table

    def row(name, world, ep, edp, tokens_per_s, loss):
        return dict(name=name, world=world, tp=1, pp=1, ep=ep, dp=world, edp=edp, loss=loss, grad_norm=1.0,
                    entropy=2.0, step_s=1.0, tokens_per_s=tokens_per_s, mfu=0.3, peak_mem_gib=80.0, peak_rss_gib=9.0,
                    expected=dict(predicted_s=0.6, predicted_gib=82.4))

    rows = [row("ep4dp4", 4, 4, 1, 50_000, 0.3243), row("ep4edp2", 8, 4, 2, 90_000, 0.3244),
            dict(name="ep8", world=8, tp=1, pp=1, ep=8, dp=8, edp=1, error="CUDA out of memory")]
    doc = dict(arch="gptoss-20b", dtype="bfloat16", steps=4, warmup=2, rtol=2e-2, layouts=rows,
               batch=dict(groups=16, samples=8, prompt=128, response=384, max_tokens=8192))
    doc.update(compare(rows, doc["rtol"]))
    md = table(doc)
    assert doc["baseline"] == "ep4dp4" and doc["agree"] and rows[1]["scaling"] == pytest.approx(1.8)
    assert rows[1]["efficiency"] == pytest.approx(0.9)  # 8 GPUs against 4
    lines = md.splitlines()
    header = next(x for x in lines if x.startswith("| layout "))
    width = header.count("|")
    body = [x for x in lines if x.startswith("| ep")]
    assert all(x.count("|") == width for x in body), md
    assert body[1].startswith("| ep4edp2 | 8 | 1 | 1 | 4 | 8 | 2 | 0.324400") and body[1].endswith("| 0.600 | 82.4 |")
    assert "failed: CUDA out of memory" in body[2] and body[2].endswith("| - | - |")
