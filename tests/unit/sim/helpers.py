"""Shared helpers for the simulator tests."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
#: The shared public traces live next to the repository (``<repo>/../shared/traces``).
TRACES = REPO.parent / "shared" / "traces"

needs_traces = pytest.mark.skipif(not (TRACES / "README.md").is_file(), reason=f"shared traces not found at {TRACES}")
