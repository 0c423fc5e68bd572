"""Shared command-line handling: --config, dotted overrides, --dry-run. Imports nothing heavy."""

from __future__ import annotations

import argparse
import sys

from offpolicy.config import Config, ConfigError, load_config, to_yaml


def parser(prog: str, description: str, config_positional: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description,
                                epilog="overrides: dotted fields, e.g. algo.max_staleness=0 learner.lr=1e-6")
    if config_positional:
        p.add_argument("config", help="YAML run config, e.g. configs/quickstart.yaml")
    else:
        p.add_argument("--config", "-c", default=None, help="YAML run config (default: built-in defaults)")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides applied after the file")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    return p


def resolve(args: argparse.Namespace) -> Config:
    """Load and validate the config; on error print the message (field and fix) and exit 2."""
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.dry_run:
        print(to_yaml(cfg), end="")
        raise SystemExit(0)
    return cfg


def setup_runtime(cfg: Config, daemon: str) -> None:
    """Logging and torch threads for a daemon process (imports torch)."""
    from offpolicy.logs import setup_logging

    setup_logging(daemon, cfg.run.log_level)
    if cfg.run.torch_threads:
        import torch

        torch.set_num_threads(cfg.run.torch_threads)


def checked(check, *args):
    """`check(*args)` (a preflight check); a ConfigError becomes one `error:` line on stderr and exit code 2."""
    try:
        return check(*args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
