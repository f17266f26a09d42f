"""The process group: set-up, DDP and the same-job guard (``distributed``), every collective on its backend's device
(``comm``), and the check that refuses on CPU what NCCL would refuse (``devicecheck``)."""
