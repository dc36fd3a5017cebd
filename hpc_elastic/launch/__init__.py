"""Submitting training jobs (``hpc-elastic submit``) and running them inside the allocation (the wrapper)."""
