"""benchmarks/megatron_layouts.py's report: each row against the baseline (`compare`) and the markdown table (`table`),
with the planner's expectation of each layout beside what it measured (`expected`: its lines before a run)."""

from __future__ import annotations


def compare(rows: list[dict], rtol: float) -> dict:
    """Scaling and step-1 agreement of every row against the 1-GPU row (else the first that ran)."""
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return dict(baseline=None, max_rel_loss_diff=None, agree=False)
    base = next((r for r in ok if r["world"] == 1), ok[0])
    rel = lambda a, b: abs(a - b) / max(abs(b), 1e-12)  # noqa: E731
    for r in ok:
        r["scaling"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["efficiency"] = r["scaling"] / (r["world"] / base["world"])
        r["rel_loss_diff"] = rel(r["loss"], base["loss"])
        r["rel_grad_norm_diff"] = rel(r["grad_norm"], base["grad_norm"])
        r["rel_entropy_diff"] = rel(r["entropy"], base["entropy"])
    worst = max(r["rel_loss_diff"] for r in ok)
    return dict(baseline=base["name"], max_rel_loss_diff=worst,
                max_rel_grad_norm_diff=max(r["rel_grad_norm_diff"] for r in ok),
                max_rel_entropy_diff=max(r["rel_entropy_diff"] for r in ok), agree=worst <= rtol)


def expected(layout: dict) -> str:
    """One layout's planner line: step s, peak GiB and its parts, host GiB; or why the planner refuses it."""
    e = layout.get("expected") or {}
    if e.get("problem") or "predicted_s" not in e:
        return f"{layout['name']}: no expectation ({e.get('problem') or 'not predicted'})"
    m = e["memory_gib"]
    return (f"{layout['name']} ({layout['world']} GPUs, tp {layout['tp']} pp {layout['pp']} ep {layout['ep']} dp "
            f"{layout['dp']} edp {layout['edp']}): step {e['predicted_s']:.3f} s, peak {e['predicted_gib']:.1f} GiB a "
            f"GPU ({m['params']:.1f} weights + {m['grads']:.1f} grads + {m['optimizer']:.1f} optimizer + "
            f"{m['activations']:.1f} activations + {m['logits']:.1f} logits), host {e['predicted_host_gib']:.0f} GiB"
            + (f"; OVER the GPU's {e['gpu_gib']:.1f} GiB" if e["predicted_gib"] > e["gpu_gib"] else ""))


def table(doc: dict) -> str:
    b = doc["batch"]
    lines = [f"arch {doc['arch']} ({doc.get('params') or '?'} params), {doc['dtype']}, batch {b['groups']} groups x "
             f"{b['samples']} x ({b['prompt']} + {b['response']}) tokens, max_tokens_per_gpu {b['max_tokens']}, "
             f"step time = mean of steps {doc['warmup'] + 1}..{doc['steps']}; planner: offpolicy plan's expectation", "",
             "| layout | GPUs | tp | pp | ep | dp | edp | step-1 loss | rel. diff vs base | grad norm | entropy | step s | "
             "tokens/s | scaling | per-GPU eff. | MFU | peak mem GiB | ready s | gather s | first publish s | publish s | "
             "publish GB/s | x host copy | stall % | step slowdown % | optimizer s | host GiB | planner step s | "
             "planner GiB |", "|" + " --- |" * 29]
    nan = float("nan")
    for r in doc["layouts"]:
        head = f"| {r['name']} | {r['world']} | {r['tp']} | {r['pp']} | {r['ep']} | {r['dp']} | {r.get('edp', '-')} |"
        e = r.get("expected") or {}
        planner = f" {e['predicted_s']:.3f} | {e['predicted_gib']:.1f} |" if "predicted_s" in e else " - | - |"
        if "error" in r:
            lines.append(head + f" failed: {r['error'].replace('|', '/')} |" + " |" * 19 + planner)
            continue
        mem = r["peak_mem_gib"] if r["peak_mem_gib"] is not None else r["peak_rss_gib"]
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        lines.append(head + f" {r['loss']:.6f} | {r['rel_loss_diff']:.1e} | {r['grad_norm']:.5f} | "
                     f"{r['entropy']:.5f} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['scaling']:.2f}x | "
                     f"{r['efficiency']:.2f} | {mfu} | "
                     f"{mem:.2f}{'' if r['peak_mem_gib'] is not None else ' (RSS)'} | "
                     f"{r.get('ready_s', r.get('build_s', nan)):.1f} | {r.get('gather_s', nan):.3f} | "
                     f"{r.get('fresh_s', nan):.3f} | {r.get('publish_s', nan):.3f} | "
                     f"{r.get('publish_gbps', nan):.1f} | {r.get('publish_vs_copy', nan):.2f} | "
                     f"{r.get('stall_pct', nan):.1f} | {r.get('slowdown_pct', nan):.0f} | "
                     f"{r.get('optimizer_s', nan):.3f} | {r.get('peak_rss_gib', nan):.1f} |" + planner)
    if doc["baseline"] is not None:
        lines.append(f"\nstep-1 loss vs layout {doc['baseline']}: max relative difference "
                     f"{doc['max_rel_loss_diff']:.2e} (tolerance {doc['rtol']:g}: "
                     f"{'agree' if doc['agree'] else 'DISAGREE'}); grad norm {doc['max_rel_grad_norm_diff']:.2e}, "
                     f"entropy {doc['max_rel_entropy_diff']:.2e}")
    return "\n".join(lines)
