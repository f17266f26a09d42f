"""The run reported to the job's trackers (``report_to: [mlflow, wandb]``), from the controller only: the ranks keep
writing their records into runs/<job-id>/, and ``feed.Feed`` follows those records and forwards them.

- ``records``: the run's records as a tracker takes them (parameters, metric points per step, devices, artifacts);
- ``state``: runs/<job-id>/tracking.json, each tracker's run ids and how far it was fed;
- ``backend``: what every tracker does (``Backend``), and the setup it is built from;
- ``mlflow_backend``, ``wandb_backend``: the two trackers;
- ``feed``: the background worker that opens, feeds and ends the trackers' runs (docs/monitoring.md).
"""
