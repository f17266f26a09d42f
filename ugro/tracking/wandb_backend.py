"""The W&B tracker: one W&B run per job, through the Run object ``wandb.init`` returns (never the module-level
``wandb.log``). Its files go to runs/<job-id>/wandb (an offline run stays there for `wandb sync`)."""

from __future__ import annotations

import netrc
import os
import re
import secrets
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

from train.config import JobConfig
from ugro.tracking.records import Point

STEP = "step"  # the custom step metric: every metric is plotted against the run's step (define_metric)
INIT_TIMEOUT_S = 30.0
DEFAULT_BASE_URL = "https://api.wandb.ai"


def _has_key(base_url: str) -> bool:
    """An API key for ``base_url``'s host where W&B looks for one: WANDB_API_KEY, an identity token file, or the
    netrc entry `wandb login` writes (a run must never stop at a login prompt)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(base_url).hostname or ""
    try:
        return netrc.netrc(os.environ.get("NETRC") or None).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbBackend:
    name = "W&B"

    def __init__(
        self, project: str, entity: str | None, mode: Literal["online", "offline"], run_dir: Path, run_name: str
    ) -> None:
        self.project, self.entity, self.mode = project, entity, mode
        self.run_dir, self.run_name = run_dir, run_name
        self.base_url = os.environ.get("WANDB_BASE_URL") or DEFAULT_BASE_URL
        self.where = f"{'offline ' + str(run_dir / 'wandb') if mode == 'offline' else self.base_url}, project {project}"
        self.fix = (
            "check the directory is writable"
            if mode == "offline"
            else "set WANDB_API_KEY or run `wandb login`, check WANDB_BASE_URL, or set wandb.mode: offline"
        )
        self.run: Any = None

    @classmethod
    def for_job(cls, job: JobConfig, run_dir: Path) -> WandbBackend:
        """The job's keys win over W&B's variables (WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE); the project is else the
        job's name, the mode online. The key and WANDB_BASE_URL are W&B's own to read."""
        project = job.wandb.project or os.environ.get("WANDB_PROJECT") or job.name
        entity = job.wandb.entity or os.environ.get("WANDB_ENTITY") or None
        mode = job.wandb.mode or os.environ.get("WANDB_MODE") or "online"
        return cls(project, entity, "offline" if mode in ("offline", "dryrun") else "online", run_dir, run_dir.name)

    def open(self, ids: dict[str, str]) -> dict[str, str]:
        import wandb

        if self.mode == "online" and not _has_key(self.base_url):
            raise RuntimeError(f"no API key for {self.base_url}")
        run_id = ids.get("id") or re.sub(r"[^\w-]", "-", f"{self.run_name}-{secrets.token_hex(3)}")[-64:]
        folder = self.run_dir / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(
            init_timeout=INIT_TIMEOUT_S,
            console="off",  # the controller's console is its own
            silent=True,
            x_disable_stats=True,  # the controller's machine is not where the run computes
            x_disable_meta=True,
            save_code=False,
            disable_git=True,
            x_save_requirements=False,
        )
        self.run = wandb.init(project=self.project, entity=self.entity, mode=self.mode, dir=str(self.run_dir),
                              id=run_id, name=self.run_name, resume="allow", settings=settings)  # fmt: skip
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)
        return {"id": run_id, "project": self.project, "entity": self.entity or "", "mode": self.mode}

    def log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.run.config.update(tags, allow_val_change=True)

    def log_points(self, points: list[Point]) -> None:
        for point in points:
            if point.values:
                self.run.log({STEP: point.step, **point.values})

    def log_artifacts(self, files: list[tuple[Path, str]]) -> None:
        import wandb

        artifact = wandb.Artifact(re.sub(r"[^\w\-.]", "-", self.run_name), type="model")
        for path, folder in files:
            # immutable: the run's own files, read where they lie (not copied into W&B's staging area)
            if path.is_dir():
                artifact.add_dir(str(path), name=folder or None, policy="immutable")
            else:
                artifact.add_file(str(path), name=f"{folder}/{path.name}" if folder else None, policy="immutable")
        self.run.log_artifact(artifact)

    def finish(self, state: str) -> None:
        try:
            self.run.finish(exit_code=0 if state == "finished" else 1)
        finally:
            self.close()

    def detach(self) -> None:
        """Marked preempting, so that W&B shows it as a run to be continued (`make follow` resumes it)."""
        try:
            self.run.mark_preempting()
        finally:
            self.close()

    def close(self) -> None:
        """Ends W&B's service process (wandb-core), which ``wandb.init`` started."""
        import wandb

        wandb.teardown()
