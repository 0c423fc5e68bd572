"""`offpolicy bench`: measurements as ratios against a baseline taken in the same run.

One module per benchmark (`transport`, `weights`, `rollout`, `pipeline`), each with `add_arguments`
(its command-line options), `run(args) -> dict` (the JSON result) and `table(result) -> str` (a
markdown table). `common` holds what they share: the machine description every result carries,
free ports, a median, and writing `<out>/<name>.json` and `<out>/<name>.md`. `cli` is `offpolicy bench`.
Nothing is imported here, so `offpolicy bench --help` stays instant.

May import: config, plumbing, wire, data, models, weights, relay, hub, loggers, learner, rollout, launch (docs/architecture.md, "Dependency rule").
"""
