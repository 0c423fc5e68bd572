"""The `tensorboard` logger (run.tensorboard): event files in one logdir per run directory.

Each start of the learner adds an event file to the same directory (`<run dir>/tensorboard` by
default), which TensorBoard reads as one run; a resumed learner writes only steps after the last one
written, so every series keeps going forward. The resolved config is a text summary, `config`.
Written through torch's SummaryWriter (it needs the `tensorboard` package: pip install
'offpolicy[tensorboard]').
"""

from __future__ import annotations

from pathlib import Path

import yaml

from offpolicy.config import Config


class TensorBoardLogger:
    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg = cfg.run.tensorboard
        self.dir = Path(self.cfg.dir or run_dir / "tensorboard")
        self.writer = None

    def start(self, state, config: dict, resume: bool) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(self.dir), flush_secs=self.cfg.flush_secs)
        state.update_run("tensorboard", dir=str(self.dir))
        text = yaml.safe_dump(config, sort_keys=False)
        self.writer.add_text("config", "```\n" + text + "```", global_step=max(state.last_step("tensorboard"), 0))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self.writer.close()
