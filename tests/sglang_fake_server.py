"""The stand-in SGLang server (tests/sglang_fake.py) as a process that `offpolicy run` launches in place of
`python -m sglang.launch_server` (rollout.sglang.launch=[python, -m, tests.sglang_fake_server]).

It takes the server command's flags as SGLang's argument parser would (0.5.14 server_args.py: --model-path, --host,
--port, --tp-size, --dtype, --random-seed, --custom-weight-loader A B ..., store-true booleans; flags it does not model
are accepted and ignored) and generates with the quickstart's model through the embedded torch engine (`TorchSGLang`),
built from the run's overrides (OFFPOLICY_FAKE_SGLANG_OVERRIDES, a JSON list: the same seed and arch as the
`sglang-initial-model` the launcher saved, so the same weights), loading every version the rollout daemon sends.
OFFPOLICY_FAKE_SGLANG_TOKEN_S > 0 turns on token mode (a token every that many seconds, aborts end requests midway).
It serves until SIGTERM (OFFPOLICY_FAKE_SGLANG_IGNORE_SIGTERM=1: until SIGKILL), and says on stderr what it was
launched with, as a real server's log does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from offpolicy.config import load_config
from offpolicy.rollout.engines import SamplingParams
from offpolicy.weights import WeightVersion
from tests.sglang_fake import FakeSGLang

QUICKSTART = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "quickstart.yaml")


class TorchSGLang:
    """The quickstart model behind the stand-in server: a sampler and a weight loader."""

    def __init__(self, overrides: list[str]):
        from offpolicy.rollout.engines.torch_engine import TorchEngine

        self.engine = TorchEngine(load_config(QUICKSTART, [*overrides, "rollout.device=cpu"]), seed=0)
        self.lock = threading.Lock()
        self.loaded: list[str] = []

    def sample(self, rows: list[list[int]], sps: list[dict]) -> list[tuple[list[int], list[float], str]]:
        """One generate of the rows that share sampling params (a lease's; continuations differ in max_new_tokens)."""
        out: list = [None] * len(rows)
        for key in {json.dumps(sp, sort_keys=True) for sp in sps}:
            sp, idx = json.loads(key), [i for i, s in enumerate(sps) if json.dumps(s, sort_keys=True) == key]
            params = SamplingParams(n=1, temperature=sp["temperature"], top_p=sp["top_p"], top_k=max(sp["top_k"], 0),
                                    max_new_tokens=sp["max_new_tokens"], stop_token_ids=tuple(sp["stop_token_ids"]))
            with self.lock:
                groups = self.engine.generate([rows[i] for i in idx], params)
            for i, (c,) in zip(idx, groups):
                out[i] = (c.tokens.tolist(), c.logprobs.tolist(), c.finish_reason)
        return out

    def update(self, path: str) -> None:
        with self.lock, WeightVersion(path) as wv:
            self.engine.load(wv)
            self.loaded.append(path)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="sglang_fake_server")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    for flag in ("--tp-size", "--ep-size", "--dp-size"):
        p.add_argument(flag, type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--random-seed", type=int)
    p.add_argument("--custom-weight-loader", nargs="*", default=[])
    for flag in ("--skip-tokenizer-init", "--enable-metrics", "--enable-deterministic-inference"):
        p.add_argument(flag, action="store_true")
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, ignored = parse(sys.argv[1:] if argv is None else argv)
    model = TorchSGLang(json.loads(os.environ.get("OFFPOLICY_FAKE_SGLANG_OVERRIDES", "[]")))
    fake = FakeSGLang(sampler=model.sample, on_update=model.update, deterministic=args.enable_deterministic_inference,
                      model_path=args.model_path, host=args.host, port=args.port)
    fake.custom_weight_loader, fake.tp_size = list(args.custom_weight_loader), args.tp_size
    fake.token_s = float(os.environ.get("OFFPOLICY_FAKE_SGLANG_TOKEN_S", "0"))
    fake.mark_versions = False  # the model's own logprobs, which the learner checks
    print(f"stand-in SGLang server at {fake.url}: model {args.model_path}, seed {args.random_seed}, dtype "
          f"{args.dtype}, custom weight loaders {args.custom_weight_loader}, ignored {ignored}", file=sys.stderr,
          flush=True)
    stop = threading.Event()
    if os.environ.get("OFFPOLICY_FAKE_SGLANG_IGNORE_SIGTERM") != "1":  # "1": outlives SIGTERM, as SGLang does for
        signal.signal(signal.SIGTERM, lambda *_: stop.set())  # seconds, so a stop must SIGKILL it
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while not stop.wait(0.5):
        pass
    fake.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
