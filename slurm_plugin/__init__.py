"""hpc-elastic-sched: a daemon beside slurmctld that steers Slurm with Tiresias (NSDI'19) decisions.

Slurm keeps node selection, backfill and accounting; each pass of this daemon decides order (SiteFactor or
Priority), checkpointed preemption, placement constraints and elastic sizes, and applies only the differences
through :mod:`hpc_elastic.slurm` (the only code that runs Slurm commands).

Modules: :mod:`.config` (TOML, validated), :mod:`.store` (durable per-job accounting), :mod:`.observe`
(Slurm -> policy views, pure), :mod:`.actions` (decision -> typed actions, pure), :mod:`.apply` (actions ->
Slurm), :mod:`.daemon` (the pass loop), :mod:`.metrics` (Prometheus), :mod:`.cli` (``hpc-elastic-sched``).
"""
