"""Prometheus metrics of a relay (or of the learner-side shard server), in a registry of their own.

Served on `relay.metrics_port` (0 = off) by `offpolicy.plumbing.metrics.serve`. Names follow the project's
conventions; labels stay low-cardinality (a direction, an outcome, a reason).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TRANSFER_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RelayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.bytes = Counter("offpolicy_relay_bytes_total", "Chunk bytes received from upstream (in) and served "
                             "downstream (out)", ["direction"], registry=r)
        self.version = Gauge("offpolicy_relay_weight_version", "Newest complete version in this node's store",
                             registry=r)
        self.version.set(-1)  # none yet: a scrape before the first version must not read version 0
        self.lag = Gauge("offpolicy_relay_version_lag", "Newest version heard of minus newest complete version "
                         "on this node", registry=r)
        self.transfer_seconds = Histogram("offpolicy_relay_transfer_seconds", "Time from a version's offer to its "
                                          "rename into this node's store", buckets=_TRANSFER_BUCKETS, registry=r)
        self.checksum_failures = Counter("offpolicy_relay_checksum_failures_total", "Versions refused because a "
                                         "file did not match the manifest", registry=r)
        self.versions = Counter("offpolicy_relay_versions_total", "Versions by outcome: complete, refused "
                                "(checksum), skipped (gone upstream before it could be fetched)", ["outcome"],
                                registry=r)
        self.upstream_switches = Counter("offpolicy_relay_upstream_switches_total", "Times a silent upstream was "
                                         "skipped and the relay re-attached further up", registry=r)
        self.rejected = Counter("offpolicy_messages_rejected_total", "Frames that failed to decode or validate",
                                ["reason"], registry=r)
        for direction in ("in", "out"):  # exported from the start, at 0
            self.bytes.labels(direction)
        for outcome in ("complete", "refused", "skipped"):
            self.versions.labels(outcome)
