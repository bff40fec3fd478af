"""The W&B run of a training run: made by rank 0 only, continued across requeues, offline where it must be.

RUN/wandb_run.json keeps the W&B run id, the last step sent to W&B, and the offline attempts
(RUN/wandb/offline-run-*) that ended cleanly, which pretrain.sync uploads. A requeued or resumed
job opens the same W&B run again (resume="allow") and sends only the steps after that one:
steps that a lost attempt logged after its last checkpoint are already in W&B, and the resumed
job computes them again, so sending them again would log them twice. (metrics.jsonl holds the
recomputed values; the lost ones are in metrics.discarded.jsonl.)

W&B writes under RUN/wandb/. An offline run is uploaded from a machine with internet by
`python -m pretrain.sync RUN`. With mode=disabled, or on any other rank, wandb is not imported.
Trouble with W&B is reported and training goes on: metrics.jsonl always has everything.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import string
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pretrain import redaction
from pretrain.tracking import wandb_access
from pretrain.config import Config

log = logging.getLogger("pretrain")

STATE_FILE = "wandb_run.json"
INIT_TIMEOUT_S = 60
# Keys of a metrics record that are not metrics: W&B has its own step and timestamp.
NOT_LOGGED = ("step", "time")
SLURM_VARIABLES = {"slurm_job_id": "SLURM_JOB_ID", "slurm_nodelist": "SLURM_JOB_NODELIST",
                   "slurm_restart_count": "SLURM_RESTART_COUNT"}


def job_info(restarts: int, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The restart count of the run, and the Slurm job it runs in (when it does)."""
    environ = dict(os.environ) if environ is None else environ
    info: dict[str, Any] = {"restarts": restarts}
    info.update({key: environ[name] for key, name in SLURM_VARIABLES.items() if name in environ})
    return info


def new_run_id() -> str:
    """A fresh W&B run id, in W&B's own style (8 lower-case letters and digits)."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class WandbRun:
    """Rank 0's W&B run; on other ranks, and with logging.wandb.mode=disabled, every method does nothing.

    Use as a context manager around training, so that the W&B run is finished (as failed, on an
    exception) before the process moves on.
    """

    def __init__(self, cfg: Config, is_main: bool) -> None:
        self.cfg = cfg
        self.settings = cfg.logging.wandb
        self.enabled = is_main and self.settings.mode != "disabled"
        self.run_dir = Path(cfg.run_dir)
        self.state_path = self.run_dir / STATE_FILE
        self.run: Any = None
        self.sent_before = 0  # steps up to this one were sent to W&B by earlier attempts
        self.last_sent = 0
        self.ended: list[str] = []  # offline attempts (their folders under RUN/wandb) that ended cleanly

    def start(self, restarts: int) -> None:
        """Open (or reopen) the W&B run; call once the job knows its restart count, i.e. after resuming."""
        if not self.enabled:
            return
        mode, why_offline = wandb_access.choose_mode(self.settings.mode)
        if why_offline:
            log.warning("W&B: %s; logging offline", why_offline)
        state = read_state(self.run_dir)
        self.sent_before = self.last_sent = state["last_step"]
        self.ended = state["ended"]
        self._save_state(state["id"])
        self.run = self._init(mode, state["id"])
        if self.run is None and mode == "online":
            mode, self.run = "offline", self._init("offline", state["id"])
        if self.run is None:
            return
        self.run.config.update(self._config(restarts), allow_val_change=True)
        if mode == "online":
            log.info("W&B: run %s at %s", self.run.id, self.run.url)
        else:
            log.info("W&B: offline run %s in %s (upload with: python -m pretrain.sync %s)", self.run.id,
                     self.run_dir / "wandb", self.run_dir)

    def _init(self, mode: str, run_id: str) -> Any:
        import wandb

        try:
            return wandb.init(
                project=self.settings.project, entity=self.settings.entity, group=self.settings.group,
                name=self.settings.name or self.run_dir.name, tags=list(self.settings.tags), id=run_id,
                resume="allow", dir=str(self.run_dir), mode=mode,
                # Silent: wandb's own advice (`wandb online`, `wandb sync`) does not fit here; the
                # lines logged by this class say what happens and how to upload.
                settings=wandb.Settings(silent=True, init_timeout=INIT_TIMEOUT_S),
            )
        except Exception as err:  # wandb raises many kinds; none of them should stop training
            log.warning("W&B: could not start the %s run (%s)%s", mode, _one_line(err),
                        "; logging offline" if mode == "online" else "; training goes on without W&B")
            _teardown(wandb)  # else the failed run keeps its id "in use" for the offline attempt
            return None

    def _config(self, restarts: int) -> dict[str, Any]:
        return redaction.scrub({**asdict(self.cfg), "job": job_info(restarts)})

    def log(self, record: dict[str, Any]) -> None:
        """Send one metrics.jsonl record, unless an earlier attempt already sent its step."""
        step = record["step"]
        if self.run is None or step <= self.sent_before:
            return
        try:
            self.run.log({k: _as_table(v) if k == "samples" else v for k, v in record.items() if k not in NOT_LOGGED},
                         step=step)
        except Exception as err:  # see _init
            log.warning("W&B: logging stopped at step %d (%s); metrics.jsonl has everything", step, _one_line(err))
            self.run = None
            return
        if step > self.last_sent:
            self.last_sent = step
            self._save_state(self.run.id)

    def finish(self, exit_code: int = 0) -> None:
        if self.run is None:
            return
        run, self.run = self.run, None
        try:
            attempt = Path(run.dir).parent.name
            run.finish(exit_code=exit_code)
        except Exception as err:  # see _init
            log.warning("W&B: could not finish the run cleanly (%s)", _one_line(err))
            return
        self.ended.append(attempt)
        self._save_state(run.id)

    def __enter__(self) -> WandbRun:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.finish(exit_code=0 if exc_type is None else 1)

    def _save_state(self, run_id: str) -> None:
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        tmp.write_text(json.dumps({"id": run_id, "last_step": self.last_sent, "ended": self.ended}) + "\n")
        os.replace(tmp, self.state_path)


def _as_table(samples: list[dict[str, str]]) -> Any:
    """train.sample_every's continuations as a W&B table: one row per prompt."""
    import wandb

    return wandb.Table(columns=["prompt", "text"], data=[[sample["prompt"], sample["text"]] for sample in samples])


def read_state(run_dir: Path) -> dict[str, Any]:
    """RUN/wandb_run.json: the W&B run id, the last step sent, the attempts that ended; a new id if none."""
    path = Path(run_dir) / STATE_FILE
    if path.is_file():
        state = json.loads(path.read_text())
        return {"id": state["id"], "last_step": int(state.get("last_step", 0)), "ended": list(state.get("ended", []))}
    return {"id": new_run_id(), "last_step": 0, "ended": []}


def _teardown(wandb: Any) -> None:
    try:
        wandb.teardown()
    except Exception as err:  # see WandbRun._init
        log.warning("W&B: could not shut down after the failure (%s)", _one_line(err))


def _one_line(err: BaseException) -> str:
    """The error's message on one line, scrubbed: wandb's messages may quote settings."""
    return redaction.scrub(" ".join(str(err).split())) or type(err).__name__
