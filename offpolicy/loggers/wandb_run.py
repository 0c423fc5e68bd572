"""The `wandb` logger (run.wandb): one W&B run per run directory, continued on --resume.

The run id is made here at the first start and kept in trackers.json; a resumed learner calls
`wandb.init(id=..., resume="allow")` with it, so its steps go to the same run. Offline mode
(`run.wandb.mode: offline` or env WANDB_MODE=offline) writes `<dir>/wandb/offline-run-*/`, one folder
per start of the learner, all with the same run id: `wandb sync` uploads them into that one run.
wandb does not capture the daemon's stdout (console="off"); the learner's own log has it.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from offpolicy.config import Config

ID_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"  # a W&B run id: 8 of these, as wandb makes them


class WandbLogger:
    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg, self.w = cfg, cfg.run.wandb
        self.dir = Path(self.w.dir or run_dir)
        self.run = None

    def start(self, state, config: dict, resume: bool) -> None:
        import wandb

        kept = state.run("wandb")
        kept.setdefault("id", "".join(secrets.choice(ID_CHARS) for _ in range(8)))
        self.dir.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(init_timeout=self.w.init_timeout_s, console="off", silent=True)
        self.run = wandb.init(project=self.w.project, entity=self.w.entity, name=self.w.name or self.cfg.run.name,
                              group=self.w.group or None, tags=self.w.tags or None, id=kept["id"], resume="allow",
                              dir=str(self.dir), mode=self.w.mode or None, config=config, settings=settings)
        kept["project"] = self.w.project

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
