"""Prometheus metrics of the daemons, each in its own registry, served on `metrics.port` (0 = off).

Names follow Prometheus conventions: `offpolicy_<what>_total` for counters, `_seconds` and `_bytes`
units, gauges for levels. Labels stay low-cardinality (a reason, never a prompt or lease id).
`scrape` reads a daemon's /metrics (benchmarks, tests), and never mistakes its own request for an answer.
"""

from __future__ import annotations

import http.client
import logging
import socket

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger("offpolicy.metrics")

_STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_IO_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class LearnerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.samples = Counter("offpolicy_samples_received_total", "Responses received from rollouts", registry=r)
        self.tokens = Counter("offpolicy_tokens_received_total", "Response tokens received", registry=r)
        self.groups = Counter("offpolicy_groups_received_total", "Sample groups received", registry=r)
        self.groups_trained = Counter("offpolicy_groups_trained_total", "Sample groups trained on", registry=r)
        self.groups_filtered = Counter("offpolicy_groups_filtered_total",
                                       "Groups left out of a step because all their rewards were equal", registry=r)
        self.groups_dropped = Counter("offpolicy_groups_dropped_total", "Sample groups refused or dropped",
                                      ["reason"], registry=r)
        self.groups_dropped.labels("stale")  # exported from the start, at 0: alerts and dashboards rate it
        self.rejected = Counter("offpolicy_messages_rejected_total", "Messages that failed to decode or validate",
                                ["reason"], registry=r)
        self.connections = Counter("offpolicy_connection_events_total",
                                   "Connection events on the hub's sockets (accepted, disconnected, auth_failed, ...)",
                                   ["event"], registry=r)
        self.leases_issued = Counter("offpolicy_leases_issued_total", "Leases granted", registry=r)
        self.leases_expired = Counter("offpolicy_leases_expired_total", "Leases that ran out or lost their daemon",
                                      registry=r)
        self.prompts_leased = Counter("offpolicy_prompts_leased_total", "Prompts handed out in leases", registry=r)
        self.version = Gauge("offpolicy_weight_version", "Newest published weight version", registry=r)
        self.version.set(-1)  # none yet: a scrape before the first version must not read version 0
        self.step = Gauge("offpolicy_learner_step", "Optimizer steps done", registry=r)
        self.startup = Gauge("offpolicy_learner_startup_seconds",
                             "Learner start-up by phase: backend (build and load the model, every rank), its parts "
                             "(megatron: setup, build, load, wrap), ready (daemon start to hub bound, version 0 "
                             "published) and first_step (daemon start to the first step's version published)",
                             ["phase"], registry=r)
        self.publish_seconds = Histogram("offpolicy_weight_publish_seconds", "Time to publish a weight version",
                                         buckets=_IO_BUCKETS, registry=r)
        self.publish_bytes = Gauge("offpolicy_weight_version_bytes", "Bytes of the newest weight version",
                                   registry=r)
        self.format_bytes = Gauge("offpolicy_weight_format_bytes", "Tensor bytes of the newest version per format",
                                  ["format"], registry=r)
        self.format_seconds = Gauge("offpolicy_weight_format_publish_seconds",
                                    "Quantize + write time of the newest version per format", ["format"], registry=r)
        self.step_seconds = Histogram("offpolicy_step_seconds", "Wall time per training step (incl. waiting)",
                                      buckets=_STEP_BUCKETS, registry=r)
        self.train_seconds = Histogram("offpolicy_train_seconds", "Forward/backward/optimizer time per step",
                                       buckets=_STEP_BUCKETS, registry=r)
        self.wait_seconds = Histogram("offpolicy_batch_wait_seconds", "Time the learner waited for a batch",
                                      buckets=_STEP_BUCKETS, registry=r)
        self.queue_depth = Gauge("offpolicy_buffered_groups", "Groups received and waiting to be trained",
                                 registry=r)
        self.in_flight = Gauge("offpolicy_inflight_groups", "Groups leased and not yet returned", registry=r)
        self.rollouts = Gauge("offpolicy_rollouts_connected", "Rollout daemons heard from recently", registry=r)
        self.staleness = Histogram("offpolicy_sample_staleness", "Step minus generating version of trained groups",
                                   buckets=(0, 1, 2, 3, 4, 8), registry=r)
        self.reward = Gauge("offpolicy_reward_mean", "Mean reward of the last trained batch", registry=r)
        self.loss = Gauge("offpolicy_loss", "Policy loss of the last step", registry=r)
        self.clip = Gauge("offpolicy_clip_fraction", "Fraction of tokens whose ratio was clipped", registry=r)
        self.kl = Gauge("offpolicy_approx_kl", "Approximate KL(behaviour || current) of the last step", registry=r)
        self.entropy = Gauge("offpolicy_entropy", "Mean token entropy of the last step", registry=r)


class RolloutMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.samples = Counter("offpolicy_rollout_samples_total", "Responses generated", registry=r)
        self.tokens = Counter("offpolicy_rollout_tokens_total", "Response tokens generated", registry=r)
        self.groups_sent = Counter("offpolicy_rollout_groups_sent_total", "Sample groups sent to the hub", registry=r)
        self.groups_refused = Counter("offpolicy_rollout_groups_refused_total", "Groups the hub refused",
                                      ["reason"], registry=r)
        self.leases = Counter("offpolicy_rollout_leases_total", "Leases received", registry=r)
        self.rejected = Counter("offpolicy_messages_rejected_total", "Messages that failed to decode or validate",
                                ["reason"], registry=r)
        self.version = Gauge("offpolicy_rollout_weight_version", "Weight version the engine holds", registry=r)
        self.version.set(-1)  # none yet: a scrape before the first version must not read version 0
        self.load_seconds = Histogram("offpolicy_weight_load_seconds", "Time to swap the engine to a new version",
                                      buckets=_IO_BUCKETS, registry=r)
        self.prefetch_seconds = Histogram("offpolicy_weight_prefetch_seconds", "Background read of a version into "
                                          "the spare weights (rollout.double_buffer), per version swapped in",
                                          buckets=_IO_BUCKETS, registry=r)
        self.prefetches = Counter("offpolicy_weight_prefetches_total", "Background reads of versions "
                                  "(rollout.double_buffer) by outcome: swapped, superseded, failed, unstaged",
                                  ["outcome"], registry=r)
        self.staged_bytes = Gauge("offpolicy_weight_staged_bytes", "Bytes of the last version loaded that the "
                                  "engine's servers took staged (vLLM, rollout.vllm.prefetch), summed over their "
                                  "workers, by where: host or device", ["where"], registry=r)
        self.gen_seconds = Histogram("offpolicy_generate_seconds", "Time per generation batch",
                                     buckets=_STEP_BUCKETS, registry=r)
        self.prompt_tokens = Counter("offpolicy_rollout_prompt_tokens_total", "Prompt tokens of the generate calls "
                                     "by kind: computed in prefill, or cached (the server's prefix cache held them); "
                                     "SGLang and vLLM servers that report them", ["kind"], registry=r)
        self.idle_seconds = Counter("offpolicy_rollout_idle_seconds_total", "Time spent waiting for work",
                                    registry=r)
        self.busy = Gauge("offpolicy_rollout_busy_groups", "Groups being generated now", registry=r)
        self.reward = Gauge("offpolicy_rollout_reward_mean", "Mean reward of the last generation batch", registry=r)
        self.aborted = Counter("offpolicy_rollout_samples_aborted_total",
                               "Samples the engine aborted and generated again (SGLang and vLLM aborts)", registry=r)
        self.loads = Counter("offpolicy_weight_loads_total", "Weight loads of the engine (per server), by how the "
                             "version got in and whether its proof (vLLM: fingerprint; SGLang: read-back) held",
                             ["method", "proven"], registry=r)


class EvalMetrics:
    """The eval daemon's figures; the gauges hold the newest evaluated version's results."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.pass_at_k = Gauge("offpolicy_eval_pass_at_k", "pass@k of the newest evaluated weight version", ["k"],
                               registry=r)
        self.reward = Gauge("offpolicy_eval_reward_mean", "Mean reward of the newest evaluated version", registry=r)
        self.tokens = Gauge("offpolicy_eval_response_tokens_mean", "Mean response length (tokens) of the newest "
                            "evaluated version", registry=r)
        self.version = Gauge("offpolicy_eval_weight_version", "Weight version of the eval figures", registry=r)
        self.version.set(-1)  # none yet: a scrape before the first version must not read version 0
        self.pending = Gauge("offpolicy_eval_pending_versions", "Wanted versions held, waiting to be evaluated",
                             registry=r)
        self.versions = Counter("offpolicy_eval_versions_total", "Weight versions evaluated", registry=r)
        self.skipped = Counter("offpolicy_eval_versions_skipped_total", "Wanted versions not evaluated", ["reason"],
                               registry=r)
        for reason in ("behind", "collected"):
            self.skipped.labels(reason)  # exported from the start, at 0
        self.samples = Counter("offpolicy_eval_samples_total", "Responses generated and scored for evaluation",
                               registry=r)
        self.seconds = Histogram("offpolicy_eval_seconds", "Time to evaluate one weight version",
                                 buckets=_STEP_BUCKETS + (1800, 3600), registry=r)


class LauncherMetrics:
    """`offpolicy run`'s own figures: the processes it supervises and whether the run makes progress."""

    CAUSES = ("learner_down", "rollouts_down", "servers_down", "unknown")  # offpolicy_launcher_stalled's causes

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.up = Gauge("offpolicy_launcher_process_up", "1 while the supervised process runs", ["process"],
                        registry=r)
        self.restarts = Counter("offpolicy_launcher_restarts_total", "Restarts of a supervised process after an "
                                "unexpected exit", ["process"], registry=r)
        self.exits = Counter("offpolicy_launcher_unexpected_exits_total", "Unexpected exits of a supervised process, "
                             "by how (exit code or signal name)", ["process", "how"], registry=r)
        self.since_step = Gauge("offpolicy_launcher_seconds_since_step", "Seconds since the learner's last "
                                "training step (or the start)", registry=r)
        self.stalled = Gauge("offpolicy_launcher_stalled", "1 while no training step came for "
                             "run.supervise.stall_timeout_s, labelled by the cause the launcher sees", ["cause"],
                             registry=r)
        for cause in self.CAUSES:
            self.stalled.labels(cause).set(0)


def serve(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> None:
    """Serve /metrics for `registry` on host:port in a background thread; port 0 = off."""
    if port:
        start_http_server(port, addr=host, registry=registry)
        log.info("serving Prometheus metrics on http://%s:%d/metrics", host, port)


class _Connection(http.client.HTTPConnection):
    """An HTTP connection that refuses a TCP self-connect: on Linux a connect to a local port in the ephemeral
    range that nobody listens on can pick that same port as its source and connect to itself, and the client
    would then read its own request back (`BadStatusLine: GET /metrics HTTP/1.1`) while holding the port the
    daemon is about to bind."""

    def connect(self) -> None:
        super().connect()
        if self_connected(self.sock):
            self.sock.close()
            self.sock = None
            raise ConnectionRefusedError(f"{self.host}:{self.port}: the connect reached itself (nothing listens)")


def self_connected(sock: socket.socket) -> bool:
    """Whether a connected TCP socket is connected to itself."""
    return sock.getsockname() == sock.getpeername()


def scrape(port: int, host: str = "127.0.0.1", timeout: float = 5.0) -> str | None:
    """The Prometheus text of http://host:port/metrics, or None while nothing answers there (not listening yet,
    gone, timed out, a self-connect, or not an HTTP 200)."""
    conn = _Connection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/metrics")
        r = conn.getresponse()
        body = r.read()
        return body.decode() if r.status == 200 else None
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()
