"""The MLflow tracker: one MLflow run per job through ``mlflow.tracking.MlflowClient`` (never the fluent API's
global active run), against the tracking server the job or MLflow's own variables name."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from train.config import JobConfig
from ugro.tracking.records import Point, flatten

# Where neither the job (mlflow.tracking_uri) nor MLFLOW_TRACKING_URI says: what `make mlflow-server` serves.
DEFAULT_URI = "http://127.0.0.1:5000"
# MLflow's HTTP client retries 7 times with a growing backoff and waits 120 s for an answer by default: a server
# that is down would hold the run's end for minutes. These bound it (a variable set in the environment wins).
HTTP_BOUNDS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}
STATUS = {"finished": "FINISHED", "stopped": "KILLED"}  # anything else: FAILED


def _key(name: str) -> str:
    """A param, tag or metric name as MLflow takes it (letters, digits, _ - . space : /; at most 250 characters)."""
    return re.sub(r"[^\w\-. :/]", "_", name)[:250]


class MlflowBackend:
    name = "MLflow"
    fix = "start it (`make mlflow-server` serves 127.0.0.1:5000) or set mlflow.tracking_uri / MLFLOW_TRACKING_URI"

    def __init__(self, tracking_uri: str, experiment: str, run_name: str) -> None:
        from mlflow.tracking import MlflowClient

        for variable, value in HTTP_BOUNDS.items():
            os.environ.setdefault(variable, value)
        self.where = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.run_id = ""

    @classmethod
    def for_job(cls, job: JobConfig, job_id: str) -> MlflowBackend:
        """The job's keys win over MLflow's variables; the experiment is else the job's name. Credentials
        (MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME/PASSWORD) are MLflow's own to read."""
        uri = job.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
        experiment = job.mlflow.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or job.name
        return cls(uri, experiment, job_id)

    def open(self, ids: dict[str, str]) -> dict[str, str]:
        if ids.get("run_id") and ids.get("tracking_uri") == self.where:
            run = self.client.get_run(ids["run_id"])
            self.run_id = run.info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return ids
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(self.experiment)
        run = self.client.create_run(experiment_id, run_name=self.run_name, tags={"ugro.job_id": self.run_name})
        self.run_id = run.info.run_id
        return {"tracking_uri": self.where, "experiment_id": str(experiment_id), "run_id": self.run_id}

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        flat = [Param(_key(k), v[:MAX_PARAM_VAL_LENGTH]) for k, v in flatten(params).items()]
        for at in range(0, len(flat), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=flat[at : at + MAX_PARAMS_TAGS_PER_BATCH], synchronous=True)

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag
        from mlflow.utils.validation import MAX_PARAMS_TAGS_PER_BATCH, MAX_TAG_VAL_LENGTH

        found = [RunTag(_key(k), v[:MAX_TAG_VAL_LENGTH]) for k, v in tags.items()]
        for at in range(0, len(found), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, tags=found[at : at + MAX_PARAMS_TAGS_PER_BATCH], synchronous=True)

    def log_points(self, points: list[Point]) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        metrics = [Metric(_key(k), v, int(p.time * 1000), p.step) for p in points for k, v in p.values.items()]
        for at in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[at : at + MAX_METRICS_PER_BATCH], synchronous=True)

    def log_artifacts(self, files: list[tuple[Path, str]]) -> None:
        for path, folder in files:
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), folder or None)
            else:
                self.client.log_artifact(self.run_id, str(path), folder or None)

    def finish(self, state: str) -> None:
        self.client.set_terminated(self.run_id, STATUS.get(state, "FAILED"), int(time.time() * 1000))

    def detach(self) -> None:
        """The run stays RUNNING: `make follow` continues it."""

    def close(self) -> None:
        """Nothing to release: the client holds no process."""
