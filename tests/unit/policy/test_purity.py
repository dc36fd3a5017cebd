"""The policy package is pure (the README's layout): importing every module of it loads none of the project's
adapters (Slurm, launch, environment, daemon) and nothing that runs commands or talks to the network."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

PROBE = """
import importlib, pkgutil, sys
import hpc_elastic.policy as package
for info in pkgutil.iter_modules(package.__path__):
    importlib.import_module(f"hpc_elastic.policy.{info.name}")
ours = sorted(name for name in sys.modules if name.split(".")[0] in ("hpc_elastic", "slurm_plugin"))
print(" ".join(name for name in ours if not name.startswith("hpc_elastic.policy")))
print(" ".join(sorted(name for name in ("subprocess", "socket", "sqlite3", "torch", "click") if name in sys.modules)))
"""


def test_policy_modules_import_no_adapter_and_nothing_that_runs_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    ours, forbidden = (out.stdout + "\n").split("\n")[:2]
    assert set(ours.split()) <= {"hpc_elastic", "hpc_elastic._dl2"}, ours
    assert forbidden == "", forbidden
