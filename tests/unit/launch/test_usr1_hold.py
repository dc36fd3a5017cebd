"""Slurm's time-limit warning (USR1) may come before the wrapper's handler is in place: it is held, not fatal."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

from tests.conftest import REPO

WRAPPER = REPO / "wrappers" / "hpc-elastic-run"


def test_a_usr1_held_before_the_handler_reaches_it_once_taken() -> None:
    code = textwrap.dedent(
        """
        import os, signal, sys, time
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # as the wrapper's first statement
        os.kill(os.getpid(), signal.SIGUSR1)  # the warning, before the handler (default action: terminate)
        time.sleep(0.2)
        from hpc_elastic.launch.supervisor import take_usr1
        seen = []
        previous = take_usr1(lambda signum, frame: seen.append(signum))
        for _ in range(100):
            if seen:
                break
            time.sleep(0.01)
        print(seen == [signal.SIGUSR1], previous is signal.SIG_DFL)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert done.returncode == 0, done.stderr  # a USR1 not held would have ended it with -10
    assert done.stdout.split() == ["True", "True"]


def test_the_wrapper_blocks_usr1_before_it_imports_anything_of_the_package() -> None:
    body = ast.parse(WRAPPER.read_text()).body
    block = next(i for i, node in enumerate(body) if "pthread_sigmask" in ast.unparse(node))
    first_package_import = next(
        i for i, node in enumerate(body) if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hpc_")
    )
    assert "SIG_BLOCK" in ast.unparse(body[block]) and "SIGUSR1" in ast.unparse(body[block])
    assert block < first_package_import
