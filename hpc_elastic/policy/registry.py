"""Policies by name: the simulator's ``--policy`` and the Slurm daemon look them up here."""

from __future__ import annotations

from collections.abc import Callable

from hpc_elastic.policy.hetero import EasyScaleHeter, EasyScaleHomo, TiresiasLasEasyScale
from hpc_elastic.policy.policies import BUILTIN_POLICIES, Dl2GpuFallback, Policy, PolicyOptions

PolicyFactory = Callable[[PolicyOptions], Policy]

_CLASSES: tuple[type[Policy], ...] = (*BUILTIN_POLICIES, EasyScaleHomo, EasyScaleHeter)
#: policies for the Slurm daemon only: ``tiresias-las+easyscale`` is ``easyscale-homo`` under the daemon's name
#: (the simulator runs it as ``easyscale-homo``); ``dl2`` is ``tiresias-las`` on GPU jobs, and DL² on the ps-mode
#: jobs of CPU partitions (the simulator's ``dl2`` is a slot policy: ``hpc-elastic simulate-ps``)
_DAEMON_ONLY: tuple[type[Policy], ...] = (TiresiasLasEasyScale, Dl2GpuFallback)
_BUILTIN: dict[str, PolicyFactory] = {cls.name: cls for cls in (*_CLASSES, *_DAEMON_ONLY)}

#: The built-in policy names (the simulator's).
POLICY_NAMES: tuple[str, ...] = tuple(cls.name for cls in _CLASSES)
#: Those the Slurm daemon can carry out: not the policies that plan a job's GPUs on several types at once
#: (``Policy.plans_per_type``), and EasyScale with one type per job's plan.
DAEMON_POLICY_NAMES: tuple[str, ...] = tuple(cls.name for cls in (*_CLASSES, *_DAEMON_ONLY) if not cls.plans_per_type)


def policy_names(extra: dict[str, PolicyFactory] | None = None) -> tuple[str, ...]:
    """Built-in names (the simulator's) plus those in ``extra``."""
    return POLICY_NAMES + tuple(name for name in (extra or {}) if name not in _BUILTIN)


def make_policy(
    name: str, options: PolicyOptions | None = None, extra: dict[str, PolicyFactory] | None = None
) -> Policy:
    """Build the policy called ``name``; ``extra`` adds or overrides factories without global state."""
    factories = {**_BUILTIN, **(extra or {})}
    factory = factories.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(factories)}")
    return factory(options or PolicyOptions())
