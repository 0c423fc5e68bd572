"""transformers in a daemon, without scikit-learn and scipy.

transformers imports two optional libraries as its model classes load, each for what offpolicy never uses:
scikit-learn (with pandas and most of scipy) for assisted decoding's confidence threshold
(`sklearn.metrics.roc_curve`, transformers/generation/candidate_generator.py; offpolicy's engines sample with their
own loops or a server), and `scipy.optimize` for the object-detection losses' Hungarian matching
(transformers/loss/loss_for_object_detection.py and its siblings; offpolicy trains causal LMs with its own loss).
Where they are installed (mlflow needs scikit-learn) every daemon start paid for both imports (docs/benchmarks.md,
"The default test suite"). `skip_unused` tells transformers they are absent, in this process only; a daemon (and
`offpolicy verify`) calls it before it loads a model class. Imports transformers' import checks (part of
`import transformers`), nothing else.
"""

from __future__ import annotations

UNUSED = ("is_sklearn_available", "is_scipy_available")  # transformers' checks of what no daemon needs from it


def skip_unused() -> None:
    """transformers' model classes, generation utilities and losses load as if scikit-learn and scipy were not
    installed (they check `is_sklearn_available` / `is_scipy_available` as they import: assisted decoding then keeps
    its fixed threshold, and the object-detection losses, which no causal LM uses, are unavailable)."""
    import transformers.utils as tu
    import transformers.utils.import_utils as iu

    def absent() -> bool:
        return False

    for name in UNUSED:
        setattr(tu, name, absent)
        setattr(iu, name, absent)
