"""The layout of an offpolicy job: which daemon runs where, on which GPUs and ports; Prometheus targets.

    plan.py slurm --config C [overrides] --nodes NAME=ADDR,... --job-id J [layout options]
        called by offpolicy.sbatch: checks the layout against the config, moves an earlier run
        directory aside (unless --resume), creates <run dir>/logs/, writes the job's Prometheus
        file_sd target list and prints the layout as shell assignments for the batch script to eval.
    plan.py targets --config C [overrides] --out FILE [--host H]
        the target list of a one-machine `offpolicy run` (learner metrics.port, rollout i
        metrics.port + 1 + i, the eval daemon after them, the vLLM or SGLang servers it launches on
        rollout.<engine>.server_port + i), for trying deploy/prometheus/ without Slurm.

Layout rules (docs/deploy.md): one node holds everything; with more nodes the first --learner-nodes
are the learner's and the rest the rollouts'. A rollout node runs gpus_per_node / gpus_per_server
rollout servers (0 GPUs: --rollouts-per-node), rollout i on rollout node i // servers_per_node,
metrics port metrics.port + 1 + i. The eval daemon (eval.every_versions > 0) runs on the learner's
first node, on its GPUs eval.gpus (none: CPU), metrics port metrics.port + 1 + rollouts. With
rollout.engine vllm or sglang in http mode and no rollout.<engine>.urls, the job runs a server per rollout daemon,
as `offpolicy run` does (the server step, named after the engine, deploy/slurm/server.py): server i on rollout i's
node and GPUs, port rollout.<engine>.server_port + i, listening on metrics.host when metrics are on, and a
Prometheus target `<engine>-<i>` (role vllm or sglang; SGLang's only with rollout.sglang.enable_metrics, without
which it serves no /metrics). Imports no torch: it runs in a second.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from offpolicy.config import Config, ConfigError, load_config
from offpolicy.config.checks import check_world
from offpolicy.launch.placement import SERVER_ENGINES, launched_servers


class PlanError(ValueError):
    """A layout that cannot work; the message says which option or field to change."""


@dataclass(frozen=True)
class Layout:
    learner_nodes: list[str]
    rollout_nodes: list[str]
    colocated: bool  # one node holds the learner and the rollouts
    learner_tasks_per_node: int
    learner_gpus: int  # colocated on GPUs: the learner's GPUs (the first ones); otherwise 0 = all of the node
    rollouts_per_node: int
    gpus_per_server: int  # 0 = CPU rollouts
    gpu_offset: int  # first GPU of rollout servers on their node (after a colocated learner's)
    relay: bool

    @property
    def n_rollouts(self) -> int:
        return len(self.rollout_nodes) * self.rollouts_per_node

    def rollout_node(self, index: int) -> str:
        return self.rollout_nodes[index // self.rollouts_per_node]


def layout(cfg: Config, nodes: list[str], learner_nodes: int = 1, learner_tasks_per_node: int = 1,
           gpus_per_node: int = 0, gpus_per_server: int | None = None, rollouts_per_node: int | None = None,
           learner_gpus: int | None = None, relay: str = "auto") -> Layout:
    if not nodes:
        raise PlanError("the job has no nodes; run this inside an allocation (SLURM_JOB_NODELIST)")
    colocated = len(nodes) == 1
    if colocated and learner_nodes != 1:
        raise PlanError(f"--learner-nodes {learner_nodes} but the job has 1 node; learner and rollouts share it")
    if not colocated and not 1 <= learner_nodes < len(nodes):
        raise PlanError(f"--learner-nodes {learner_nodes} leaves no rollout node in a job of {len(nodes)} nodes; "
                        f"use 1..{len(nodes) - 1} or submit with more nodes")
    ranks = learner_nodes * learner_tasks_per_node
    m = cfg.learner.megatron
    if cfg.learner.backend != "megatron" and ranks != 1:
        raise PlanError(f"{ranks} learner tasks, but learner.backend={cfg.learner.backend} is one process; use "
                        "--learner-nodes 1 --learner-tasks-per-node 1 (several ranks need learner.backend=megatron)")
    if cfg.learner.backend == "megatron":
        try:
            check_world(ranks, tp=m.tp, pp=m.pp, cp=m.cp, ep=m.ep, etp=m.etp)
        except ValueError as e:
            raise PlanError(f"{ranks} learner tasks (--learner-nodes x --learner-tasks-per-node): {e}") from None
    engine_gpus, engine_fields = server_gpus(cfg, gpus_per_node)
    if gpus_per_server is None:
        gpus_per_server = engine_gpus or (1 if gpus_per_node else 0)
    if engine_gpus and gpus_per_server != engine_gpus:
        raise PlanError(f"--gpus-per-server {gpus_per_server} but {engine_fields} = {engine_gpus}; make them equal")
    offset = 0
    if learner_gpus is not None and not (colocated and gpus_per_node):
        raise PlanError("--learner-gpus is for one-node GPU jobs, where learner and rollouts share the GPUs; "
                        "drop it (a learner node's GPUs are all the learner's)")
    if colocated and gpus_per_node:
        if learner_gpus is None:
            raise PlanError(f"learner and rollouts share one node with {gpus_per_node} GPUs; pass --learner-gpus K "
                            "(the learner takes the first K, the rollout servers the rest)")
        if not 0 <= learner_gpus < gpus_per_node:
            raise PlanError(f"--learner-gpus {learner_gpus} leaves no GPU for rollouts; use 0..{gpus_per_node - 1}")
        offset = learner_gpus
    if gpus_per_server:
        usable = gpus_per_node - offset
        if usable < gpus_per_server or usable % gpus_per_server:
            raise PlanError(f"{usable} GPUs per rollout node do not split into servers of {gpus_per_server}; submit "
                            "with --gpus-per-node (sbatch) or pass --gpus-per-node, or change --gpus-per-server")
        servers = usable // gpus_per_server
        if rollouts_per_node is not None and not 1 <= rollouts_per_node <= servers:
            raise PlanError(f"--rollouts-per-node {rollouts_per_node}: the GPUs hold 1..{servers} servers per node")
        rollouts_per_node = rollouts_per_node or servers
    elif rollouts_per_node is None:
        rollouts_per_node = 1
    if rollouts_per_node < 1:
        raise PlanError(f"--rollouts-per-node {rollouts_per_node}: use 1 or more")
    if relay not in ("auto", "on", "off"):
        raise PlanError(f"--relay {relay}: use auto, on or off")
    if relay == "on" and colocated:
        raise PlanError("--relay on, but learner and rollouts share one node and one /dev/shm; use --relay auto")
    learner = nodes[:1] if colocated else nodes[:learner_nodes]
    return Layout(learner, nodes[:1] if colocated else nodes[learner_nodes:], colocated, learner_tasks_per_node,
                  learner_gpus or 0, rollouts_per_node, gpus_per_server, offset,
                  relay == "on" or (relay == "auto" and not colocated))


def server_gpus(cfg: Config, gpus_per_node: int) -> tuple[int | None, str]:
    """GPUs of one rollout server as the engine's config says (None: the config does not say), and the fields."""
    r = cfg.rollout
    if r.engine == "sglang" and (r.sglang.mode == "engine" or launched_servers(cfg) and gpus_per_node):
        return r.sglang.tp_size * r.sglang.dp_size, "rollout.sglang tp_size x dp_size"
    if r.engine == "vllm" and r.device != "cpu" and gpus_per_node:
        return (r.vllm.tensor_parallel_size * r.vllm.data_parallel_size,
                "rollout.vllm tensor_parallel_size x data_parallel_size")
    return None, ""


def server_host(cfg: Config) -> str:
    """The interface the servers listen on: metrics.host when metrics are on (so Prometheus can scrape their
    /metrics), else loopback (only the rollout daemon of their node talks to them)."""
    return cfg.metrics.host if cfg.metrics.port else "127.0.0.1"


def scraped(cfg: Config) -> bool:
    """Whether the servers of the job serve Prometheus metrics on their port: vLLM always, SGLang with
    rollout.sglang.enable_metrics."""
    return launched_servers(cfg) == "vllm" or cfg.rollout.sglang.enable_metrics


def server_plan(cfg: Config, lay: Layout) -> dict[str, object]:
    """The server step (rollout.<engine>.mode http, no urls: `placement.launched_servers`, as `offpolicy run`):
    server i (rollout i's, on its node and GPUs) listens on rollout.<engine>.server_port + i; with urls the user runs
    the servers and the job starts none."""
    engine = launched_servers(cfg)
    if engine is None:
        return {"SERVERS": "", "SERVER_NAME": "", "SERVER_PORT": 0, "SERVER_HOST": ""}
    field = f"rollout.{engine}.server_port"
    first = getattr(cfg.rollout, engine).server_port
    last = first + lay.n_rollouts - 1
    # SGLang 0.5.14 derives a gRPC port of its port + 10000 and refuses to start where that passes 65535
    limit = 55535 if engine == "sglang" else 65535
    if last > limit:
        raise PlanError(f"{field} {first} + {lay.n_rollouts} servers passes {limit}"
                        f"{' (SGLang takes port + 10000 for gRPC)' if engine == 'sglang' else ''}; lower it")
    taken = {cfg.transport.work_port: "transport.work_port", cfg.transport.announce_port: "transport.announce_port"}
    if cfg.metrics.port:
        taken.update({p: "metrics.port (+ rollouts, eval)" for p in range(cfg.metrics.port,
                                                                         cfg.metrics.port + lay.n_rollouts + 2)})
    if lay.relay:
        taken.update({cfg.relay.port: "relay.port", cfg.relay.announce_port: "relay.announce_port"})
        if cfg.relay.metrics_port:
            taken[cfg.relay.metrics_port] = "relay.metrics_port"
    clash = sorted({name for p, name in taken.items() if first <= p <= last})
    if clash:
        raise PlanError(f"the {SERVER_ENGINES[engine]} servers take ports {field} {first}..{last}, which overlap "
                        f"{', '.join(clash)}; move {field}")
    return {"SERVERS": engine, "SERVER_NAME": SERVER_ENGINES[engine], "SERVER_PORT": first,
            "SERVER_HOST": server_host(cfg)}


def check_network(cfg: Config, lay: Layout) -> list[str]:
    """Errors for a multi-node job whose sockets only listen on loopback; returns warnings."""
    loopback = ("127.0.0.1", "localhost", "::1")
    if not lay.colocated and cfg.transport.bind_host in loopback:
        raise PlanError(f"transport.bind_host is {cfg.transport.bind_host} but rollouts run on other nodes; "
                        "set transport.bind_host=0.0.0.0")
    if cfg.metrics.port and not lay.colocated and cfg.metrics.host in loopback:
        return [f"metrics.host is {cfg.metrics.host}: a Prometheus on another host cannot scrape the daemons; "
                "set metrics.host=0.0.0.0"]
    return []


def targets(cfg: Config, lay: Layout, addr: dict[str, str], job: str) -> list[dict]:
    """Prometheus file_sd entries, one per daemon, labelled run, slurm_job, daemon, role, node."""
    port = cfg.metrics.port
    if not port:
        return []
    evals = int(cfg.eval.every_versions > 0)
    last = port + lay.n_rollouts + evals
    if last > 65535:
        raise PlanError(f"metrics.port {port} + {lay.n_rollouts} rollouts passes 65535; lower metrics.port")

    def entry(node: str, p: int, daemon: str, role: str) -> dict:
        return {"targets": [f"{addr.get(node, node)}:{p}"],
                "labels": {"run": cfg.run.name, "slurm_job": job, "daemon": daemon, "role": role, "node": node}}

    out = [entry(lay.learner_nodes[0], port, "learner", "learner")]
    out += [entry(lay.rollout_node(i), port + 1 + i, f"rollout-{i}", "rollout") for i in range(lay.n_rollouts)]
    if evals:  # the eval daemon runs on the learner's first node, after the rollouts' ports
        out.append(entry(lay.learner_nodes[0], port + 1 + lay.n_rollouts, "eval", "eval"))
    if (engine := launched_servers(cfg)) and scraped(cfg):  # vllm:* or sglang:* metrics on the server's API port
        out += [entry(lay.rollout_node(i), getattr(cfg.rollout, engine).server_port + i, f"{engine}-{i}", engine)
                for i in range(lay.n_rollouts)]
    if lay.relay and cfg.relay.metrics_port:
        if len(lay.learner_nodes) == 1:
            out.append(entry(lay.learner_nodes[0], cfg.relay.metrics_port, "relay-source", "relay"))
        else:  # a source on every learner node, serving that node's part of each version
            out += [entry(n, cfg.relay.metrics_port, f"relay-source-{k}", "relay") for k, n in enumerate(lay.learner_nodes)]
        out += [entry(n, cfg.relay.metrics_port, f"relay-{i}", "relay") for i, n in enumerate(lay.rollout_nodes)]
    return out


def write_targets(path: Path, entries: list[dict]) -> None:
    """Write atomically (Prometheus re-reads the file whenever it changes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(entries, indent=1) + "\n")
    os.replace(tmp, path)


def shell(values: dict[str, object]) -> str:
    """`KEY=value` lines for bash's eval; lists become comma-separated (as srun -w takes them)."""
    return "".join(f"{k}={shlex.quote(','.join(map(str, v)) if isinstance(v, list) else str(v))}\n"
                   for k, v in values.items())


def slurm(args: argparse.Namespace, cfg: Config) -> str:
    from offpolicy.loggers.runlog import prepare_run_dir, run_path

    pairs = [n.partition("=") for n in args.nodes.split(",") if n]
    nodes, addr = [n for n, _, _ in pairs], {n: a or n for n, _, a in pairs}
    lay = layout(cfg, nodes, args.learner_nodes, args.learner_tasks_per_node, args.gpus_per_node,
                 args.gpus_per_server, args.rollouts_per_node, args.learner_gpus, args.relay)
    for w in check_network(cfg, lay):
        print(f"warning: {w}", file=sys.stderr)
    run_dir = run_path(cfg).resolve()
    if args.resume:
        if not (run_dir / "checkpoints").is_dir():
            raise PlanError(f"--resume but {run_dir}/checkpoints does not exist; drop --resume to start afresh")
    else:
        prepare_run_dir(run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    entries = targets(cfg, lay, addr, args.job_id)
    targets_file = ""
    if entries:
        tdir = Path(args.targets_dir) if args.targets_dir else run_dir.parent / "prometheus-targets"
        targets_file = tdir.resolve() / f"{cfg.run.name}-{args.job_id}.json"
        write_targets(targets_file, entries)
    return shell({
        "RUN_DIR": run_dir, "LOG_DIR": run_dir / "logs", "TARGETS_FILE": targets_file,
        "LEARNER_NODES": lay.learner_nodes, "N_LEARNER_NODES": len(lay.learner_nodes),
        "LEARNER_HEAD": lay.learner_nodes[0], "LEARNER_ADDR": addr[lay.learner_nodes[0]],
        "LEARNER_TASKS_PER_NODE": lay.learner_tasks_per_node, "LEARNER_GPUS": lay.learner_gpus,
        "MASTER_PORT": cfg.learner.megatron.master_port,
        "ROLLOUT_NODES": lay.rollout_nodes, "N_ROLLOUT_NODES": len(lay.rollout_nodes),
        "ROLLOUTS_PER_NODE": lay.rollouts_per_node, "N_ROLLOUTS": lay.n_rollouts,
        "GPUS_PER_SERVER": lay.gpus_per_server, "GPU_OFFSET": lay.gpu_offset,
        "METRICS_PORT": cfg.metrics.port, "RELAY": int(lay.relay), "COLOCATED": int(lay.colocated),
        # several learner nodes: each one's address, in the learner's node order (relay.sources of the relays)
        "RELAY_SOURCES": [addr[n] for n in lay.learner_nodes] if len(lay.learner_nodes) > 1 else "",
        **eval_plan(cfg, lay), **server_plan(cfg, lay),
    })


def eval_plan(cfg: Config, lay: Layout) -> dict[str, object]:
    """The eval daemon (eval.every_versions > 0): on the learner's first node, which holds every version in
    its store; GPUs eval.gpus of that node (none: CPU); metrics port after the rollouts'."""
    e = cfg.eval
    return {"EVAL": int(e.every_versions > 0), "EVAL_GPUS": e.gpus, "EVAL_FINISH_TIMEOUT": int(e.finish_timeout_s),
            "EVAL_METRICS_PORT": cfg.metrics.port + 1 + lay.n_rollouts if cfg.metrics.port else 0}


def local_targets(args: argparse.Namespace, cfg: Config) -> str:
    lay = Layout(["localhost"], ["localhost"], True, 1, 0, cfg.run.rollouts, 0, 0, False)
    entries = targets(cfg, lay, {"localhost": args.host}, "local")
    if not entries:
        raise PlanError("metrics.port is 0 (metrics off); set metrics.port, e.g. metrics.port=9400")
    write_targets(Path(args.out), entries)
    return f"{args.out}: {len(entries)} targets\n"


def parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"plan.py {command}", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="YAML run config")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides")
    if command == "targets":
        p.add_argument("--out", required=True, help="target list to write, e.g. /etc/prometheus/offpolicy/local.json")
        p.add_argument("--host", default="127.0.0.1", help="address the daemons' metrics listen on")
        return p
    p.add_argument("--nodes", required=True, help="the job's hosts in order, comma-separated NAME or NAME=ADDR")
    p.add_argument("--job-id", default="0", help="SLURM_JOB_ID: names the job's Prometheus target file")
    p.add_argument("--learner-nodes", type=int, default=1,
                   help="nodes for the learner, the first N of the job [1]; the rest run rollouts")
    p.add_argument("--learner-tasks-per-node", type=int, default=1,
                   help="learner ranks per learner node (one per GPU with learner.backend=megatron) [1]")
    p.add_argument("--learner-gpus", type=int, default=None,
                   help="one-node jobs on GPUs only: the learner takes the first K GPUs")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node [0]")
    p.add_argument("--gpus-per-server", type=int, default=None,
                   help="GPUs per rollout server, e.g. 4 for TP4 [the engine's parallel sizes]")
    p.add_argument("--rollouts-per-node", type=int, default=None, help="rollout servers per node [GPUs / G; on CPU 1]")
    p.add_argument("--relay", default="auto", help="auto|on|off: weight relays onto the rollout nodes "
                   "[auto: when they are not the learner's]")
    p.add_argument("--targets-dir", default="", help="Prometheus file_sd directory [<run.dir>/prometheus-targets]")
    p.add_argument("--resume", action="store_true", help="continue the run: keep its run directory (it must hold checkpoints/); without it an "
                   "earlier run directory is moved aside")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("slurm", "targets"):
        print(__doc__, file=sys.stderr)
        return 2
    args = parser(argv[0]).parse_intermixed_args(argv[1:])
    try:
        cfg = load_config(args.config, args.overrides)
        print(slurm(args, cfg) if argv[0] == "slurm" else local_targets(args, cfg), end="")
    except (ConfigError, PlanError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
