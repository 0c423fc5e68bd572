"""pass@k: the unbiased estimator per prompt and the summary of an evaluation (pure functions).

For one prompt with `n` samples of which `c` pass, the unbiased estimator of the chance that at least
one of `k` samples drawn without replacement passes is (Chen et al. 2021, "Evaluating Large Language
Models Trained on Code", eq. 1)

    pass@k = 1 - C(n - c, k) / C(n, k)

computed in the numerically stable product form 1 - prod_{i = n-c+1}^{n} (1 - k / i), which never forms
a binomial coefficient (C(200, 100) overflows a float). It is 1 when n - c < k (every k-subset holds a
pass). k must lie in 1..n. The overall pass@k of a data set is the mean over its prompts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `c` passing samples out of `n`."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: c={c} passing samples out of n={n}: c must lie in 0..n")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n = {n} samples per prompt: raise eval.n_samples or drop k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def passed(rewards: Iterable[float], threshold: float) -> int:
    """How many samples pass: reward >= threshold."""
    return sum(r >= threshold for r in rewards)


def prompt_summary(rewards: Sequence[float], lengths: Sequence[int], ks: Sequence[int], threshold: float) -> dict:
    """One prompt's figures: n, passed, pass@k for each k, mean reward and mean response length."""
    n = len(rewards)
    c = passed(rewards, threshold)
    return {"n": n, "passed": c, "pass_at_k": {str(k): pass_at_k(n, c, k) for k in ks},
            "reward_mean": sum(rewards) / n, "response_tokens_mean": sum(lengths) / n}


def overall(prompts: Sequence[dict], ks: Sequence[int]) -> dict:
    """Means over prompts of `prompt_summary` records (each prompt weighs the same)."""
    m = len(prompts)
    if not m:
        raise ValueError("no evaluated prompts to summarise: the data set is empty or every prompt was filtered")
    return {"prompts": m, "samples": sum(p["n"] for p in prompts),
            "pass_at_k": {str(k): sum(p["pass_at_k"][str(k)] for p in prompts) / m for k in ks},
            "reward_mean": sum(p["reward_mean"] for p in prompts) / m,
            "response_tokens_mean": sum(p["response_tokens_mean"] for p in prompts) / m}
