"""`offpolicy-relay`: the cross-node weight relay of one rollout node, or with --serve its source.

    offpolicy-relay --serve run.yaml        on the learner node: serve the learner's store
    offpolicy-relay --serve run.yaml [--index K]   a learner on several nodes (relay.sources): on each
                                            learner node, serve that node's part of every version
    offpolicy-relay run.yaml [--index I]    on each rollout node: pull, verify, store, announce

Parses the config and the node list before importing anything heavy, so `--help` is instant.
"""

from __future__ import annotations

import sys

from offpolicy.services.args import parser, resolve


def main(argv: list[str] | None = None) -> int:
    p = parser("offpolicy-relay", "Relay weight versions from the learner node into this node's shared memory "
                                  "and on to the next node (a chain; see docs/weights.md).")
    p.add_argument("--serve", action="store_true",
                   help="run the source on the learner node: serve the versions of weights.root to relay 0 (with "
                        "relay.sources, on each learner node: serve that node's part of every version)")
    p.add_argument("--index", type=int, default=None,
                   help="this relay's place in relay.nodes (with --serve: this learner node's place in "
                        "relay.sources); default: env OFFPOLICY_RELAY_INDEX, else this host's position in "
                        "relay.nodes (or the Slurm node list; with --serve, in relay.sources)")
    args = p.parse_intermixed_args(argv)
    cfg = resolve(args)
    from offpolicy.config import ConfigError
    from offpolicy.relay import topology

    try:
        topology.check(cfg)
        hosts = [] if args.serve else topology.relay_hosts(cfg)
        index = -1 if args.serve else topology.own_index(hosts, args.index)
        part = topology.source_index(cfg, args.index) if args.serve else None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from offpolicy.plumbing.logs import setup_logging

    setup_logging(f"relay[{'source' if part is None else f'source {part}'}]" if args.serve else f"relay[{index}]",
                  cfg.run.log_level)
    from offpolicy.relay.node import RelayNode
    from offpolicy.wire import transport

    try:
        node = RelayNode(cfg, index, hosts, part)
        return transport.run(node.run)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
