"""Shared command-line handling: the config (`CONFIG` or `--config CONFIG`), dotted overrides, --dry-run.
Imports nothing heavy."""

from __future__ import annotations

import argparse
import os
import re
import sys

from offpolicy.config import Config, ConfigError, load_config, to_yaml


class _Parser(argparse.ArgumentParser):
    """An entry point's parser: the config as `CONFIG` (the first positional) or `--config CONFIG`, then
    dotted overrides, `--dry-run`. `parse_intermixed_args` leaves the config in `args.config` (None: the
    built-in defaults) and the overrides in `args.overrides`."""

    def __init__(self, *a, config_required: bool = False, **kw):
        super().__init__(*a, **kw)
        self.config_required = config_required

    def parse_intermixed_args(self, args=None, namespace=None):
        ns = super().parse_intermixed_args(args, namespace)
        if ns.config is not None and _OVERRIDE.match(ns.config) and not os.path.isfile(ns.config):
            ns.overrides.insert(0, ns.config)  # no config file first: the positionals are all overrides
            ns.config = None
        if ns.config_option is not None:
            if ns.config is not None:
                self.error(f"the config is given twice ({ns.config} and --config {ns.config_option}): give it once")
            ns.config = ns.config_option
        if ns.config is None and self.config_required:
            self.error(f"the run config is missing: {self.prog} CONFIG [section.field=value ...], "
                       f"e.g. {self.prog} configs/quickstart.yaml")
        return ns


_OVERRIDE = re.compile(r"[A-Za-z_][\w.]*=")


def parser(prog: str, description: str, config_required: bool = False) -> argparse.ArgumentParser:
    """Every entry point takes its config the same way: `PROG CONFIG [overrides]`, or the older
    `PROG --config CONFIG [overrides]`; without one (unless `config_required`) the built-in defaults."""
    p = _Parser(prog=prog, description=description, config_required=config_required,
                epilog="overrides: dotted fields, e.g. algo.max_staleness=0 learner.lr=1e-6. "
                       "CONFIG may also be given as --config CONFIG.")
    default = "" if config_required else " (default: the built-in defaults)"
    p.add_argument("config", nargs="?", metavar="CONFIG", help=f"YAML run config, e.g. configs/quickstart.yaml{default}")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides applied after the file")
    p.add_argument("--config", "-c", dest="config_option", metavar="CONFIG", default=None,
                   help="the YAML run config, as the positional CONFIG (the older form; give one of the two)")
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
    """Logging, transformers without scikit-learn and scipy (offpolicy/models/imports.py) and torch threads for a
    daemon process (imports torch and transformers' import checks)."""
    from offpolicy.models.imports import skip_unused
    from offpolicy.plumbing.logs import setup_logging

    setup_logging(daemon, cfg.run.log_level)
    skip_unused()
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
