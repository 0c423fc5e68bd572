"""`offpolicy-rollout` whose engine's first weight load takes SLOW_LOAD_S seconds (environment), as a vLLM server
reading a 42 GB version does: what the daemon does meanwhile is what a test looks at. Run as
`python -m tests.slow_first_load --config ...` from the repository root."""

from __future__ import annotations

import os
import sys
import time

from offpolicy.rollout.engines.torch_engine import TorchEngine

_load = TorchEngine.load


def _slow_first(self, weights):
    if not getattr(self, "_slowed", False):
        self._slowed = True
        time.sleep(float(os.environ["SLOW_LOAD_S"]))
    return _load(self, weights)


TorchEngine.load = _slow_first

if __name__ == "__main__":
    from offpolicy.services.rollout import main

    sys.exit(main())
