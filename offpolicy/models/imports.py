"""transformers in a daemon, without scikit-learn.

transformers imports scikit-learn (and with it pandas and most of scipy) when its generation utilities load, for
one thing only: assisted decoding's confidence threshold (`sklearn.metrics.roc_curve`, transformers/generation/
candidate_generator.py), which offpolicy never uses (its engines sample with their own loops or a server). Where
scikit-learn is installed (mlflow needs it) every daemon start paid for that import (docs/benchmarks.md, "The
default test suite"). `skip_sklearn` tells transformers that it is absent, in this process only; a daemon calls it
before it loads a model class. Imports transformers' import checks (part of `import transformers`), nothing else.
"""

from __future__ import annotations


def skip_sklearn() -> None:
    """transformers' generation utilities load as if scikit-learn were not installed (they check
    `is_sklearn_available` as they import; assisted decoding then keeps its fixed threshold)."""
    import transformers.utils as tu
    import transformers.utils.import_utils as iu

    def absent() -> bool:
        return False

    tu.is_sklearn_available = iu.is_sklearn_available = absent
