"""The `wandb` logger (run.wandb): one W&B run per run directory, continued on --resume.

The run id is made here at the first start and kept in trackers.json; a resumed learner calls
`wandb.init(id=..., resume="allow")` with it, so its steps go to the same run. Offline mode
(`run.wandb.mode: offline` or env WANDB_MODE=offline) writes `<dir>/wandb/offline-run-*/`, one folder
per start of the learner, all with the same run id: `wandb sync` uploads them into that one run.
wandb does not capture the daemon's stdout (console="off"); the learner's own log has it. The run's group
is `run.wandb.group`, else `run.name`; the eval daemon's results go to a run of their own in that group,
`<name>-eval` (job type eval), at step = weight version.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from offpolicy.config import Config

ID_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"  # a W&B run id: 8 of these, as wandb makes them


class WandbLogger:
    def __init__(self, cfg: Config, run_dir: Path, role: str = "learner"):
        self.cfg, self.w, self.role = cfg, cfg.run.wandb, role
        self.dir = Path(self.w.dir or run_dir)
        self.run = None

    def start(self, state, config: dict, resume: bool) -> None:
        import wandb

        kept = state.run("wandb")
        kept.setdefault("id", "".join(secrets.choice(ID_CHARS) for _ in range(8)))
        state.update_run("wandb", id=kept["id"], project=self.w.project)
        self.dir.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(init_timeout=self.w.init_timeout_s, console="off", silent=True)
        name = self.w.name or self.cfg.run.name
        self.run = wandb.init(project=self.w.project, entity=self.w.entity,
                              name=name if self.role == "learner" else f"{name}-{self.role}",
                              group=self.w.group or self.cfg.run.name, job_type=self.role, tags=self.w.tags or None,
                              id=kept["id"], resume="allow", dir=str(self.dir), mode=self.w.mode or None, config=config,
                              settings=settings)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
