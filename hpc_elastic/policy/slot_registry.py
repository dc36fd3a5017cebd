"""Slot policies (the PS-job model of DL², :mod:`hpc_elastic.policy.slots`) by name, as the slot simulator's
``--policy`` names them; ``extra`` adds or overrides factories (the DL² policy adds ``"dl2"`` so)."""

from __future__ import annotations

from collections.abc import Callable

from hpc_elastic.policy.drf import Drf
from hpc_elastic.policy.optimus import OptimusLike
from hpc_elastic.policy.slot_tiresias import SlotTiresiasLas, SlotTiresiasLasElastic
from hpc_elastic.policy.slots import SlotPolicy

SlotPolicyFactory = Callable[[], SlotPolicy]

_BUILTIN: dict[str, SlotPolicyFactory] = {
    cls.name: cls for cls in (Drf, OptimusLike, SlotTiresiasLas, SlotTiresiasLasElastic)
}

#: the built-in slot policies
SLOT_POLICY_NAMES: tuple[str, ...] = tuple(_BUILTIN)


def slot_policy_names(extra: dict[str, SlotPolicyFactory] | None = None) -> tuple[str, ...]:
    """Built-in names plus those in ``extra``."""
    return SLOT_POLICY_NAMES + tuple(name for name in (extra or {}) if name not in _BUILTIN)


def make_slot_policy(name: str, extra: dict[str, SlotPolicyFactory] | None = None) -> SlotPolicy:
    """The slot policy called ``name``; ValueError naming it and the choices when there is none."""
    factories = {**_BUILTIN, **(extra or {})}
    factory = factories.get(name)
    if factory is None:
        raise ValueError(f"unknown slot policy {name!r}; choose from {', '.join(factories)}")
    return factory()
