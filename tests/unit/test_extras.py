"""What ``make demo`` installs (extras torch, metrics, plot) must be enough for the code a training job and the
daemon run: the wrapper, the runtime, submit and the scheduler import neither grpcio (extra ps) nor psutil (extras
profile and balance)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

PROBE = """
import importlib, sys
for name in ("grpc", "psutil"):
    sys.modules[name] = None  # an import of it now fails, as where the extra is not installed
for module in ("hpc_elastic.launch.run", "hpc_elastic.cli.main", "hpc_elastic.cli.submit", "hpc_elastic.session",
               "hpc_elastic.state", "hpc_elastic.est.example", "slurm_plugin.cli", "slurm_plugin.daemon"):
    importlib.import_module(module)
print("ok")
"""


def test_the_demos_code_paths_import_without_the_ps_and_profile_extras() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
