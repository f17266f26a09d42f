"""ugro's controller: the `ugro` command that validates a job, runs the playbooks and follows the run."""
