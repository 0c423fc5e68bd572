"""The `mlflow` logger (run.mlflow): one MLflow run per run directory, continued on --resume.

The run is created in `run.mlflow.experiment` (made when missing) with the flattened resolved config
as its parameters; its id is kept in trackers.json, and a resumed learner logs into the same run
(status RUNNING again, FINISHED at the end). The store is `run.mlflow.tracking_uri`, else env
MLFLOW_TRACKING_URI, else a local SQLite store `<run dir>/mlflow.db` (artifacts beside it) that needs no
server: `mlflow ui --backend-store-uri sqlite:///<run dir>/mlflow.db` shows it. The eval daemon logs its
results into the same run (its id from trackers.json) at step = weight version; the learner ends it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from offpolicy.config import Config

PARAMS_PER_CALL = 100  # MLflow's limit of parameters in one log_batch
LEARNER_WAIT_S = 300.0  # the eval daemon waits this long for the learner's MLflow run to exist


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    """`{"a": {"b": 1}}` -> `{"a.b": "1"}`: the config as MLflow parameters (values as strings, cut at 6000)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)[:6000]
    return out


class MlflowLogger:
    def __init__(self, cfg: Config, run_dir: Path, role: str = "learner"):
        self.cfg, self.m, self.role = cfg, cfg.run.mlflow, role
        self.run_dir = Path(run_dir).resolve()
        self.client = self.run_id = None

    def tracking_uri(self) -> str:
        return self.m.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{self.run_dir / 'mlflow.db'}"

    def start(self, state, config: dict, resume: bool) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = self.tracking_uri()
        if self.role != "learner":  # the learner's run, once it exists (a client would make an empty store first)
            self.run_id = learner_run_id(self.run_dir, uri)
            self.client = MlflowClient(tracking_uri=uri)
            return
        self.client = client = MlflowClient(tracking_uri=uri)
        kept = state.run("mlflow")
        if kept.get("run_id") and kept.get("tracking_uri") == uri:
            self.run_id = kept["run_id"]
            client.update_run(self.run_id, status="RUNNING")
            return
        exp = client.get_experiment_by_name(self.m.experiment)
        if exp is not None:
            exp_id = exp.experiment_id
        else:
            local = not (self.m.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))
            exp_id = client.create_experiment(self.m.experiment,
                                              artifact_location=(self.run_dir / "mlartifacts").as_uri() if local else None)
        run = client.create_run(exp_id, run_name=self.m.run_name or self.cfg.run.name, tags=self.m.tags)
        self.run_id = run.info.run_id
        state.update_run("mlflow", run_id=self.run_id, tracking_uri=uri, experiment_id=exp_id)
        state.save()  # the run exists now: a crash from here on must still resume into it
        params = [Param(k, v) for k, v in flatten(config).items()]
        for i in range(0, len(params), PARAMS_PER_CALL):
            client.log_batch(self.run_id, params=params[i:i + PARAMS_PER_CALL])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self) -> None:
        if self.role == "learner":  # the learner's run: the eval daemon adds to it, the learner ends it
            self.client.set_terminated(self.run_id, "FINISHED")


def learner_run_id(run_dir: Path, uri: str, wait_s: float = LEARNER_WAIT_S) -> str:
    """The learner's MLflow run id from <run dir>/trackers.json, waiting for the learner to create it."""
    from offpolicy.loggers.state import TrackerState

    deadline = time.monotonic() + wait_s
    while True:
        kept = TrackerState.load(run_dir / "trackers.json").run("mlflow")
        if kept.get("run_id") and kept.get("tracking_uri") == uri:
            return kept["run_id"]
        if time.monotonic() > deadline:
            raise RuntimeError(f"no MLflow run of the learner in {run_dir / 'trackers.json'} after {wait_s:.0f} s "
                               f"(tracking store {uri}): eval results are not sent to MLflow")
        time.sleep(1.0)
