"""Running a job: following it, supervising it, recovering from a lost host, replicating checkpoints."""
