"""What a planned run does each step: batch, group size, prompt and response lengths, leases, weights.

`Workload` mirrors the run config fields that set the pipeline's timing (learner.batch_groups,
rollout.n_samples, rollout.max_new_tokens, rollout.groups_per_lease, rollout.prefetch_leases,
algo.max_staleness, the weights.* publish path) and adds the response-length distribution, whose
long tail sets how long a lease takes: a lease ends when its longest response does.
`Lengths` parses `fixed:L`, `uniform:LO:HI` or `lognormal:MEDIAN:SIGMA` (responses cut at
max_new_tokens, as the engines cut them) and samples it from a seeded generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Lengths:
    kind: str  # fixed, uniform, lognormal
    a: float
    b: float = 0.0

    @staticmethod
    def parse(text: str) -> Lengths:
        kind, _, rest = text.partition(":")
        try:
            args = [float(x) for x in rest.split(":")] if rest else []
        except ValueError:
            args = None
        want = {"fixed": 1, "uniform": 2, "lognormal": 2}.get(kind)
        if want is None or args is None or len(args) != want or min(args, default=1) <= 0:
            raise ValueError(f"--lengths {text!r}: use fixed:L, uniform:LO:HI or lognormal:MEDIAN:SIGMA "
                             "(positive numbers), e.g. lognormal:1500:0.8")
        return Lengths(kind, *args)

    def sample(self, rng: np.random.Generator, size: int, cap: int) -> np.ndarray:
        """`size` response lengths, each in [1, cap]."""
        if self.kind == "fixed":
            x = np.full(size, self.a)
        elif self.kind == "uniform":
            x = rng.uniform(self.a, self.b, size)
        else:
            x = self.a * np.exp(self.b * rng.standard_normal(size))
        return np.clip(np.round(x), 1, cap).astype(np.int64)

    def mean(self, cap: int, rng_seed: int = 0) -> float:
        return float(self.sample(np.random.default_rng(rng_seed), 20000, cap).mean())

    def __str__(self) -> str:
        return f"{self.kind}:" + ":".join(f"{v:g}" for v in ((self.a,) if self.kind == "fixed" else (self.a, self.b)))


@dataclass(frozen=True)
class Workload:
    batch_groups: int = 128  # learner.batch_groups
    n: int = 8  # rollout.n_samples
    prompt_tokens: int = 512  # mean prompt length
    max_new_tokens: int = 8192  # rollout.max_new_tokens
    lengths: Lengths = Lengths("lognormal", 1500, 0.8)  # response lengths before the cut
    groups_per_lease: int = 0  # rollout.groups_per_lease; 0 = batch_groups / rollout servers (every server busy)
    prefetch_leases: int = 1  # rollout.prefetch_leases
    publish: str = "fast"  # weights path: fast (a GPU learner's auto: reuse_files + maps, no checksum), none (fresh
    #                        pages every version), sha256 (each rank hashes what it writes)
    steps: int = 12  # learner steps simulated (the first `warmup` are left out of the means)
    fresh_pages: bool = False  # the run's first versions.FRESH_VERSIONS versions into fresh pages (a short bench run)
    warmup: int = 3
    seed: int = 0

    def lease_groups(self, servers: int) -> int:
        """Groups per lease: as given, or the batch spread over the servers."""
        return self.groups_per_lease or max(1, -(-self.batch_groups // max(1, servers)))

    def mean_response(self) -> float:
        return self.lengths.mean(self.max_new_tokens)

    def seq_len(self) -> float:
        """Mean trained sequence (prompt + response)."""
        return self.prompt_tokens + self.mean_response()

    def check(self) -> None:
        if self.groups_per_lease < 0:
            raise ValueError(f"--groups-per-lease {self.groups_per_lease}: use 0 (auto) or more")
        for name in ("batch_groups", "n", "prompt_tokens", "max_new_tokens", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")
        if self.publish not in ("sha256", "none", "fast"):
            raise ValueError(f"--publish {self.publish!r}: use sha256, none or fast")
        if self.steps <= self.warmup + 1:
            raise ValueError(f"--steps {self.steps} must exceed the {self.warmup} warm-up steps by 2 or more")
