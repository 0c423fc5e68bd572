"""The command line is consistent: every argument of every parser of the CLI (`offpolicy` and its
subcommands, the daemons) has help text, every entry point takes its config the same way (`CONFIG` or
`--config CONFIG`), and `offpolicy run` without one says what is missing.

The parsers are built inside each entry point's `main`; the walk calls each `main` with the argv that
reaches its parser and stops it there (ArgumentParser.parse_known_args raises with the parser in hand),
so nothing runs and nothing heavy is imported. Sub-parsers are walked from their parent."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from offpolicy.bench.cli import NAMES as BENCHES
from offpolicy.services import cli, eval_daemon, learner, relay, rollout

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")

ENTRIES = {  # what reaches each parser: (main, argv)
    "offpolicy": (cli.main, []),
    "offpolicy-learner": (learner.main, []),
    "offpolicy-rollout": (rollout.main, []),
    "offpolicy-relay": (relay.main, []),
    "offpolicy-eval": (eval_daemon.main, []),
    **{f"offpolicy {c}": (cli.main, [c]) for c in ("run", "plot", "keys", "verify", "plan", "eval", "stores",
                                                            "import-gguf")},
    "offpolicy plan validate": (cli.main, ["plan", "validate"]),
    "offpolicy plan calibrate": (cli.main, ["plan", "calibrate"]),
    "offpolicy bench": (cli.main, ["bench"]),  # its parser holds one sub-parser per benchmark
}


class _Reached(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def parser_of(main, argv, monkeypatch) -> argparse.ArgumentParser:
    def stop(self, *a, **kw):
        raise _Reached(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_known_args", stop)
        with pytest.raises(_Reached) as reached:
            main(argv)
    return reached.value.parser


def walk(p: argparse.ArgumentParser):
    """(parser, action) for every argument of `p` and of its sub-parsers."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            helped = {c.dest: c.help for c in action._choices_actions}
            for name, sub in action.choices.items():
                yield p, argparse.Action([name], dest=name, help=helped.get(name))
                yield from walk(sub)
        else:
            yield p, action


def undocumented(p: argparse.ArgumentParser) -> list[str]:
    return [f"{q.prog}: {'/'.join(a.option_strings) or a.dest}" for q, a in walk(p)
            if a.help is None or (a.help != argparse.SUPPRESS and not a.help.strip())]


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_every_argument_has_help(entry, monkeypatch):
    main, argv = ENTRIES[entry]
    p = parser_of(main, argv, monkeypatch)
    assert p.prog == entry
    if entry == "offpolicy bench":
        assert set(next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices) == set(BENCHES)
    missing = undocumented(p)
    assert not missing, f"give these arguments help text: {', '.join(missing)}"


@pytest.mark.parametrize("command", ["slurm", "targets"])
def test_every_argument_of_the_deploy_planner_has_help(command, monkeypatch):
    """deploy/slurm/plan.py, which offpolicy.sbatch runs (its options are the sbatch script's)."""
    spec = importlib.util.spec_from_file_location("deploy_plan", ROOT / "deploy" / "slurm" / "plan.py")
    plan = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "deploy_plan", plan)  # its dataclasses look their module up
    spec.loader.exec_module(plan)
    missing = undocumented(plan.parser(command))
    assert not missing, f"give these arguments help text: {', '.join(missing)}"


def test_the_walk_finds_an_argument_without_help():
    p = argparse.ArgumentParser(prog="demo")
    p.add_argument("--with", help="documented")
    p.add_argument("--nodes", type=int)
    sub = p.add_subparsers(dest="cmd").add_parser("calibrate", help="a subcommand")
    sub.add_argument("bench_dir")
    assert undocumented(p) == ["demo: --nodes", "demo calibrate: bench_dir"]


@pytest.mark.parametrize("entry", ["offpolicy run", "offpolicy eval", "offpolicy-learner", "offpolicy-rollout",
                                   "offpolicy-relay", "offpolicy-eval", "offpolicy stores"])
def test_every_entry_takes_the_config_positionally_or_as_an_option(entry, monkeypatch):
    main, argv = ENTRIES[entry]
    p = parser_of(main, argv, monkeypatch)
    for form in ([QUICKSTART, "algo.max_staleness=0"], ["--config", QUICKSTART, "algo.max_staleness=0"],
                 ["algo.max_staleness=0", "-c", QUICKSTART]):
        args = p.parse_intermixed_args(form)
        assert (args.config, args.overrides) == (QUICKSTART, ["algo.max_staleness=0"]), form
    if entry != "offpolicy run":  # the others fall back to the built-in defaults
        args = p.parse_intermixed_args(["model.arch.model_type=llama", "algo.max_staleness=0"])
        assert (args.config, args.overrides) == (None, ["model.arch.model_type=llama", "algo.max_staleness=0"])


def test_a_config_given_twice_is_refused(monkeypatch, capsys):
    p = parser_of(*ENTRIES["offpolicy-learner"], monkeypatch)
    with pytest.raises(SystemExit) as e:
        p.parse_intermixed_args([QUICKSTART, "--config", QUICKSTART])
    assert e.value.code == 2 and "the config is given twice" in capsys.readouterr().err


def test_offpolicy_run_without_a_config_says_it_is_missing():
    r = subprocess.run([sys.executable, "-m", "offpolicy.services.cli", "run"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert "the run config is missing: offpolicy run CONFIG" in r.stderr and "overrides" not in r.stderr.split(
        "error:")[1], r.stderr
