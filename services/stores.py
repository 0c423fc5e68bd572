"""`offpolicy stores`: list the weight stores in shared memory and free those no live run owns.

    offpolicy stores [CONFIG] [overrides]              list <weights.root>'s stores: size, versions, owner
    offpolicy stores [...] --free NAME [NAME ...]      free these stores (refused for a live run's)
    offpolicy stores [...] --free-all                  free every store no live process owns

The root: `--root DIR`, else `weights.root` of the config given, else the default /dev/shm/offpolicy.
Exit code 2 when a named store does not exist or is live (nothing else is freed then), 0 otherwise.
"""

from __future__ import annotations

import sys

from offpolicy.services.args import parser, resolve


def main(rest: list[str]) -> int:
    p = parser("offpolicy stores", "List the weight stores under weights.root (size, versions, live owner) and "
                                   "free the ones no live run owns (docs/operations.md).")
    p.add_argument("--root", help="store root (default: the config's weights.root)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--free", nargs="+", metavar="NAME", help="free these stores (run names)")
    group.add_argument("--free-all", action="store_true", help="free every store that no live process owns")
    args = p.parse_intermixed_args(rest)
    from offpolicy.config import WeightsConfig
    from offpolicy.plumbing import stores

    if args.root:
        root = args.root
    elif args.config or args.overrides:
        root = resolve(args).weights.root
    else:
        root = WeightsConfig().root
    found = stores.list_stores(root)
    if not (args.free or args.free_all):
        print(f"{root}:\n{stores.table(found)}")
        return 0
    names = [s.name for s in found if s.owner is None] if args.free_all else args.free
    if args.free:
        known = {s.name: s for s in found}
        problems = [f"no store {n!r} in {root}" if n not in known else
                    f"store {n!r} is live ({stores.describe(known[n].owner)}): stop that run first"
                    for n in names if n not in known or known[n].owner is not None]
        if problems:
            print(f"error: {'; '.join(problems)}; nothing freed (`offpolicy stores` lists them)", file=sys.stderr)
            return 2
    total = 0
    for n in names:
        try:
            size = stores.free(root, n)
        except stores.StoreLive as e:  # it became live since the listing
            print(f"error: {e}", file=sys.stderr)
            return 2
        total += size
        print(f"freed {root}/{n} ({size / 2**20:,.1f} MiB)")
    if not names:
        print(f"no store to free in {root}")
    elif len(names) > 1:
        print(f"freed {len(names)} stores, {total / 2**20:,.1f} MiB")
    return 0
