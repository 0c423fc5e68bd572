"""The `mlflow` logger (run.mlflow): one MLflow run per run directory, continued on --resume.

The run is created in `run.mlflow.experiment` (made when missing) with the flattened resolved config
as its parameters; its id is kept in trackers.json, and a resumed learner logs into the same run
(status RUNNING again, FINISHED at the end). The store is `run.mlflow.tracking_uri`, else env
MLFLOW_TRACKING_URI, else a local SQLite store `<run dir>/mlflow.db` (artifacts beside it) that needs no
server: `mlflow ui --backend-store-uri sqlite:///<run dir>/mlflow.db` shows it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from offpolicy.config import Config

PARAMS_PER_CALL = 100  # MLflow's limit of parameters in one log_batch


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
    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg, self.m = cfg, cfg.run.mlflow
        self.run_dir = Path(run_dir).resolve()
        self.client = self.run_id = None

    def tracking_uri(self) -> str:
        return self.m.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{self.run_dir / 'mlflow.db'}"

    def start(self, state, config: dict, resume: bool) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = self.tracking_uri()
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
        kept.update(run_id=self.run_id, tracking_uri=uri, experiment_id=exp_id)
        state.save()  # the run exists now: a crash from here on must still resume into it
        params = [Param(k, v) for k, v in flatten(config).items()]
        for i in range(0, len(params), PARAMS_PER_CALL):
            client.log_batch(self.run_id, params=params[i:i + PARAMS_PER_CALL])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")
