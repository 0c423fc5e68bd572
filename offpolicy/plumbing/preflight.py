"""Checks a daemon makes before it touches anything: ports, model and tokenizer paths, resume state.

Every entry point (`offpolicy run`, `offpolicy-learner`, `offpolicy-rollout`, `offpolicy-eval`,
`offpolicy eval`) runs the checks that apply to it right after parsing its config and before any
heavy import, lock-free file change or socket bind, so an operator's mistake costs one line naming the
config field and the fix (exit code 2), never a traceback and never a live run. Each check raises
`ConfigError`; nothing here imports torch.

A port is "busy" when binding it (with SO_REUSEADDR, as ZeroMQ and torch bind) fails now; the daemon
binds it for real moments later, and the run lock (offpolicy/plumbing/runlock.py) keeps a second learner of the
same run from reaching this point at all.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

from offpolicy.config import Config, ConfigError



def busy_ports(wanted: dict[str, tuple[str, int]]) -> list[str]:
    """`field=port` of every (host, port) in `wanted` that cannot be bound now."""
    busy = []
    for field, (host, port) in wanted.items():
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("" if host in ("*", "0.0.0.0") else host, port))
            except OSError:
                busy.append(f"{field}={port}")
    return busy


def _bind_host(host: str) -> str:
    return "0.0.0.0" if host == "*" else host


def master_port(cfg: Config) -> int | None:
    """The rendezvous port learner rank 0 binds (megatron: MASTER_PORT or learner.megatron.master_port);
    None when it binds none (torch backend, or torchrun's agent holds the store)."""
    if cfg.learner.backend != "megatron" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    return int(os.environ.get("MASTER_PORT") or cfg.learner.megatron.master_port)


def learner_ports(cfg: Config) -> dict[str, tuple[str, int]]:
    t = cfg.transport
    wanted = {"transport.work_port": (_bind_host(t.bind_host), t.work_port),
              "transport.announce_port": (_bind_host(t.bind_host), t.announce_port)}
    if cfg.metrics.port:
        wanted["metrics.port"] = (cfg.metrics.host, cfg.metrics.port)
    mp = master_port(cfg)
    if mp is not None:
        field = "learner.megatron.master_port" if not os.environ.get("MASTER_PORT") else "MASTER_PORT"
        wanted[field] = ("0.0.0.0", mp)  # torch's TCPStore listens on every interface
    return wanted


def metrics_ports(cfg: Config) -> dict[str, tuple[str, int]]:
    """The rollout / eval daemon's only listening port: its own metrics.port, when on."""
    return {"metrics.port": (cfg.metrics.host, cfg.metrics.port)} if cfg.metrics.port else {}


def ports_message(busy: list[str]) -> str:
    """The error for `busy` (`field=port` items): which ports, and overrides with ports free right now."""
    fields = dict.fromkeys(b.split("=")[0].split(" ")[0] for b in busy)  # "metrics.port (+2)" -> metrics.port
    from offpolicy.plumbing.ports import free_ports  # below the ephemeral range: no connection takes them meanwhile

    fix = " ".join(f"{f}={p}" for f, p in zip(fields, free_ports(len(fields))))
    return (f"ports in use: {', '.join(busy)}; another process listens there (a live run?): stop it, or pick "
            f"free ports, e.g. {fix}" + (" (metrics.port=0 turns /metrics off)" if "metrics.port" in fields else ""))


def check_ports(wanted: dict[str, tuple[str, int]]) -> None:
    busy = busy_ports(wanted)
    if busy:
        raise ConfigError(ports_message(busy))


def check_model(cfg: Config) -> None:
    """model.path (an HF model directory) and model.tokenizer ("digits" or an HF tokenizer directory) exist."""
    m = cfg.model
    if m.path is not None and m.gguf and not (Path(m.path).expanduser() / "config.json").exists():
        raise ConfigError(f"config field model.path: {m.path} holds no model yet; `offpolicy run` converts "
                          f"model.gguf into it, a daemon alone does not: offpolicy import-gguf {m.gguf} {m.path}")
    if m.path is not None:
        _directory("model.path", m.path, "config.json", "an HF model directory (config.json + safetensors)")
    if m.tokenizer != "digits":
        _directory("model.tokenizer", m.tokenizer, None, '"digits" or an HF tokenizer directory')


def check_model_dir(flag: str, value: str) -> None:
    """A command-line option naming an HF model directory (e.g. `offpolicy verify --model`)."""
    _directory(flag, value, "config.json", "an HF model directory (config.json + safetensors)", kind="option")


def check_run_dirs(dirs: list[str]) -> None:
    """`offpolicy plot RUN_DIR ...`: each a run directory holding metrics.jsonl."""
    for d in dirs:
        if not (Path(d) / "metrics.jsonl").is_file():
            what = "does not exist" if not Path(d).exists() else "has no metrics.jsonl"
            raise ConfigError(f"{d} {what}: give run directories (<run.dir>/<run.name>, e.g. runs/quickstart)")


def _directory(field: str, value: str, needs: str | None, what: str, kind: str = "config field") -> None:
    path = Path(value).expanduser()
    if not path.exists():
        hub = bool(re.fullmatch(r"[\w.-]+/[\w.-]+", value)) and not value.startswith(".")
        hint = (f"; a Hub repo id is not downloaded for you: `huggingface-cli download {value} --local-dir DIR`, "
                f"then {field}=DIR") if hub else ""
        raise ConfigError(f"{kind} {field}: {value} does not exist; give {what}{hint}")
    if not path.is_dir():
        raise ConfigError(f"{kind} {field}: {value} is a file, not a directory; give {what}")
    if needs and not (path / needs).exists():
        raise ConfigError(f"{kind} {field}: {value} has no {needs}; give {what}")


def check_megatron() -> None:
    """learner.backend=megatron needs megatron-core (the `megatron` extra), which the quickstart set-up leaves out."""
    import importlib.util

    try:
        found = importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise ConfigError("config field learner.backend: megatron needs megatron-core, which is not installed: "
                          "pip install -e '.[megatron]' (or learner.backend=torch)")


def check_weights_dir(path: str) -> None:
    """`offpolicy eval --weights PATH`: a weight version (manifest.json) or an HF model directory (config.json)."""
    p = Path(path).expanduser()
    what = "a weight version directory (manifest.json, e.g. /dev/shm/offpolicy/<run>/v<N>) or an HF model directory"
    if not p.exists():
        raise ConfigError(f"--weights {path} does not exist; give {what}, or --version N for the run's store")
    if not p.is_dir():
        raise ConfigError(f"--weights {path} is a file, not a directory; give {what}")
    if not (p / "manifest.json").exists() and not (p / "config.json").exists():
        raise ConfigError(f"--weights {path} holds neither manifest.json nor config.json; give {what}")


def check_resume(cfg: Config) -> None:
    """`--resume` needs a run directory holding a complete checkpoint (checkpoints/step-*/state.json)."""
    run_dir = Path(cfg.run.dir) / cfg.run.name
    if not run_dir.is_dir():
        raise ConfigError(f"--resume: no run directory {run_dir} (run.dir/run.name); check run.name and run.dir, "
                          "or start without --resume")
    if not list((run_dir / "checkpoints").glob("step-*/state.json")):
        raise ConfigError(f"--resume: {run_dir / 'checkpoints'} holds no complete checkpoint, so there is nothing "
                          "to resume (checkpoint.every_steps saves them, and a stopped learner writes one); start "
                          "without --resume")


def check_learner(cfg: Config, resume: bool) -> None:
    """Everything learner rank 0 needs before it takes the run: model, resume state, ports."""
    check_model(cfg)
    if resume:
        check_resume(cfg)
    check_ports(learner_ports(cfg))
