"""When a host is lost, comes back or is asked to stop: why a rank ended (``failure``), checkpoints
(``checkpoint``), the survivors' new group (``regroup``, ``survivors``, ``consensus``), a crashed host's way back
(``door``, ``rejoin``, ``comeback``) and a scheduler's warning (``preempt``)."""
