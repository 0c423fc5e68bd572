"""`offpolicy bench NAME`: the command line over the benchmark modules (`NAMES`)."""

from __future__ import annotations

from offpolicy.bench.common import envelope, write

NAMES = ("transport", "weights", "rollout", "pipeline")


def main(argv: list[str]) -> int:
    """`offpolicy bench NAME [options]`: run one benchmark, write its JSON and table, print the table."""
    import argparse
    import importlib

    top = argparse.ArgumentParser(prog="offpolicy bench", description="Benchmarks as ratios against a baseline "
                                  "measured in the same run; each writes OUT/NAME.json and OUT/NAME.md.")
    sub = top.add_subparsers(dest="name", required=True)
    modules = {}
    for name in NAMES:
        mod = importlib.import_module(f"offpolicy.bench.{name}")
        p = sub.add_parser(name, help=mod.__doc__.splitlines()[0], description=mod.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--out", default="runs/bench", help="directory for NAME.json and NAME.md")
        mod.add_arguments(p)
        modules[name] = mod
    args = top.parse_args(argv)
    mod = modules[args.name]
    result = mod.run(args)
    doc = envelope(args.name, argv[1:], result)
    markdown = mod.table(result)
    js, md = write(args.out, args.name, doc, markdown)
    print(markdown)
    print(f"\nwritten: {js} {md}")
    return 1 if result.get("failed") else 0  # a part that failed is in the table and the JSON
