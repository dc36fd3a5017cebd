"""hpc-elastic: elastic, preemptible and bitwise-reproducible deep-learning training on Slurm."""

__version__ = "0.1.0"
