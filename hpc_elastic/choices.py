"""Parsing the package's ``str`` enums from user text (CLI flags, environment variables, run specs)."""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

E = TypeVar("E", bound=StrEnum)


def parse_choice(cls: type[E], value: str | E, what: str) -> E:
    """The member of ``cls`` named by ``value`` (case and surrounding blanks ignored); ``ValueError`` naming
    ``what``, the choices and the bad value otherwise."""
    if isinstance(value, cls):
        return value
    text = str(value).strip().lower()
    for member in cls:
        if member.value == text:
            return member
    raise ValueError(f"{what} must be one of {', '.join(m.value for m in cls)}, got {value!r}")
