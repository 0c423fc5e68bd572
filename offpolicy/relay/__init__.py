"""Cross-node weight relay: every rollout node gets each version into its own shared-memory store.

    learner node                 rollout node 0             rollout node 1             ...
    WeightStore --(files)--> offpolicy-relay --serve ==> offpolicy-relay [0] ==> offpolicy-relay [1] ==> ...
                              (ShardServer on the        (Fetcher -> Incoming ->   (pulls from node 0
                               learner's store)           store; ShardServer;       while node 0 still
                                                          PUB for local readers)    receives)

A learner on several nodes has a source on each learner node, serving that node's part of every version
(`relay.sources`); relay 0 pulls each file from the source of the node that holds it and assembles the
version (docs/weights.md, "A learner on several nodes").

Modules, one concept each: `topology` (node list, own index, upstreams, config checks), `incoming`
(a version being received into the store's staging directory), `catalog` (what a node can serve),
`server` (answers offers and chunk requests), `fetch` (pulls versions from upstream, heals),
`metrics`, `node` (the daemon). The wire messages live in `offpolicy.wire.protocol`; versions enter the
store through `WeightStore.stage` and leave it through `WeightStore.collect`, as the learner's do.
Nothing here imports torch.

May import: config, plumbing, wire, weights (docs/architecture.md, "Dependency rule").
"""
