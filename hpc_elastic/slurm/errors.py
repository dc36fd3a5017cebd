"""Typed errors of the Slurm adapter.

Every failure of a Slurm command reaches callers as one of these, chained from the
:class:`subprocess.CalledProcessError` (or timeout / missing binary) that caused it, carrying argv and stderr.
"""

from __future__ import annotations

from collections.abc import Sequence

from hpc_elastic.errors import HpcElasticError


class SlurmError(HpcElasticError):
    """Base class of the adapter's errors."""


class SlurmUnavailable(SlurmError):
    """slurmctld (or slurmdbd, or munge) does not answer, or the Slurm commands are not installed."""


class SlurmCommandError(SlurmError):
    """A Slurm command failed; ``argv``, ``returncode`` and ``stderr`` say how."""

    def __init__(self, argv: Sequence[str], returncode: int | None, stderr: str, message: str = "") -> None:
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stderr = stderr.strip()
        detail = message or first_line(self.stderr) or f"exit code {returncode}"
        super().__init__(f"{self.argv[0] if self.argv else 'slurm'}: {detail}")


class JobNotFound(SlurmCommandError):
    """Slurm does not know the job id (finished and purged, or never existed)."""


class PermissionDenied(SlurmCommandError):
    """Slurm refused the operation for this user."""


class SlurmParseError(SlurmError):
    """Slurm's output could not be understood (an unexpected format or version)."""


def first_line(text: str, default: str = "") -> str:
    """The first line of ``text`` that is not blank, stripped; ``default`` when there is none."""
    return next((line.strip() for line in text.splitlines() if line.strip()), default)
