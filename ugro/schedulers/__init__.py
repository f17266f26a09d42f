"""The same job under a batch scheduler: an sbatch script for SLURM, a manifest for Kubernetes."""
