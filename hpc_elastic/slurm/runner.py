"""The one place where hpc-elastic runs Slurm commands.

argv lists only, ``shell=False``, an explicit timeout on every call, and every failure turned into a typed
error (:mod:`hpc_elastic.slurm.errors`) chained from the ``CalledProcessError`` / ``TimeoutExpired`` /
``FileNotFoundError`` that caused it. A controller that is restarting is retried with capped exponential
backoff and full jitter; writes are retried only when Slurm surely did not act (connection refused), never
after a timeout, so that an ``sbatch`` is never submitted twice.
"""

from __future__ import annotations

import logging
import random
import re
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from hpc_elastic.env import child_environment
from hpc_elastic.slurm.errors import (
    JobNotFound,
    PermissionDenied,
    SlurmCommandError,
    SlurmUnavailable,
    first_line,
)

log = logging.getLogger(__name__)

# Every command runs in UTC with ISO 8601 timestamps in text output, so parsing never depends on the site's
# locale or time zone. (``SLURM_TIME_FORMAT=%s`` would give epochs, but sacct then rejects its own
# ``--starttime``: "Invalid time specification".)
COMMAND_ENVIRONMENT = {"TZ": "UTC", "SLURM_TIME_FORMAT": "standard"}

_UNAVAILABLE = re.compile(
    r"unable to contact slurm controller|connection refused|socket timed out|zero bytes were transmitted"
    r"|communication connection failure|unable to establish connection|slurm_persist_conn_open"
    r"|unable to connect to database|problem talking to the database|munge.*(?:socket|connect)"
    r"|slurmctld.*not responding|slurm controller is not responding|Slurm backup controller in standby",
    re.IGNORECASE,
)
_NOT_FOUND = re.compile(r"invalid job id|job not found|no such job|unknown job", re.IGNORECASE)
_DENIED = re.compile(
    r"access.?(?:/permission )?denied|permission denied|not authorized|only user root|user not permitted"
    r"|requested operation not permitted",
    re.IGNORECASE,
)
# Commands that report a per-job failure on stderr but still exit 0.
_STDERR_CHECKED_ON_SUCCESS = frozenset({"scancel"})


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class RetryPolicy:
    """Capped exponential backoff with full jitter (delay_k = U(0, min(cap, base * 2**k)))."""

    attempts: int = 5
    base_s: float = 0.5
    cap_s: float = 8.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"retry attempts must be >= 1, got {self.attempts}")
        if self.base_s < 0 or self.cap_s < self.base_s:
            raise ValueError(f"retry delays need 0 <= base <= cap, got base={self.base_s} cap={self.cap_s}")


def backoff_delays(policy: RetryPolicy, rng: random.Random) -> Iterator[float]:
    """The sleep before each retry (``attempts - 1`` of them)."""
    for attempt in range(policy.attempts - 1):
        yield rng.uniform(0.0, min(policy.cap_s, policy.base_s * 2.0**attempt))


def classify(
    argv: Sequence[str], returncode: int, stderr: str, stdout: str = ""
) -> SlurmCommandError | SlurmUnavailable | None:
    """The typed error for a finished command, or None when it succeeded."""
    failed = returncode != 0
    if failed and not stderr.strip() and re.search(r"\bis DOWN\b", stdout):  # `scontrol ping`
        return SlurmUnavailable(f"{argv[0]}: Slurm is not reachable: {first_line(stdout, 'no message')}")
    if not failed and argv and argv[0] in _STDERR_CHECKED_ON_SUCCESS and _NOT_FOUND.search(stderr):
        return JobNotFound(argv, returncode, stderr)
    if not failed:
        return None
    if _UNAVAILABLE.search(stderr):
        return SlurmUnavailable(f"{argv[0]}: Slurm is not reachable: {first_line(stderr, 'no message')}")
    if _NOT_FOUND.search(stderr):
        return JobNotFound(argv, returncode, stderr)
    if _DENIED.search(stderr):
        return PermissionDenied(argv, returncode, stderr)
    return SlurmCommandError(argv, returncode, stderr)


Execute = Callable[..., "subprocess.CompletedProcess[str]"]


@dataclass
class Runner:
    """Runs Slurm commands; ``execute``, ``sleep`` and ``rng`` are injectable for tests."""

    timeout_s: float = 30.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    execute: Execute = subprocess.run
    sleep: Callable[[float], None] = time.sleep
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"Slurm command timeout must be positive, got {self.timeout_s}")

    def run(self, argv: Sequence[str], *, stdin: str | None = None, idempotent: bool = True) -> CommandResult:
        """Run ``argv``; retry while Slurm is unreachable (writes only when it surely did nothing)."""
        delays = backoff_delays(self.retry, self.rng)
        while True:
            try:
                return self._run_once(argv, stdin)
            except SlurmUnavailable as exc:
                timed_out = isinstance(exc.__cause__, subprocess.TimeoutExpired)
                missing = isinstance(exc.__cause__, FileNotFoundError)
                delay = next(delays, None)
                if delay is None or missing or (timed_out and not idempotent):
                    raise
                log.warning("%s; retrying in %.1fs", exc, delay)
                self.sleep(delay)

    def _run_once(self, argv: Sequence[str], stdin: str | None) -> CommandResult:
        command = list(argv)
        log.debug("running %s", command)
        try:
            proc = self.execute(
                command,
                input=stdin,
                capture_output=True,
                encoding="utf-8",
                errors="replace",  # a job name or comment may hold any byte (squeue --json passes them through)
                timeout=self.timeout_s,
                check=True,
                shell=False,
                env=child_environment(COMMAND_ENVIRONMENT),
            )
        except FileNotFoundError as exc:
            raise SlurmUnavailable(f"{command[0]} not found: are Slurm's client commands installed?") from exc
        except subprocess.TimeoutExpired as exc:
            raise SlurmUnavailable(f"{command[0]} did not answer within {self.timeout_s:g}s") from exc
        except subprocess.CalledProcessError as exc:
            error = classify(command, exc.returncode, _text(exc.stderr), _text(exc.stdout))
            if error is None:  # pragma: no cover - classify maps every non-zero exit to an error
                error = SlurmCommandError(command, exc.returncode, _text(exc.stderr))
            raise error from exc
        error = classify(command, proc.returncode, proc.stderr or "")
        if error is not None:
            raise error
        return CommandResult(tuple(command), proc.returncode, proc.stdout or "", proc.stderr or "")


def _text(value: str | bytes | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    output: IO[bytes] | None = None,
    cwd: str | None = None,
    new_session: bool = True,
) -> subprocess.Popen[bytes]:
    """Start a long-running step (``srun``, ``mpirun``, or the workers themselves on one host) and return at once:
    ``output`` takes its stdout and stderr (else they are ours); ``new_session``: in its own process group, so that
    the wrapper can signal it and everything it started as one (``os.killpg``). ``SlurmUnavailable`` when the
    command is not installed."""
    command = list(argv)
    log.info("starting %s", command)
    try:
        return subprocess.Popen(
            command,
            env=None if env is None else dict(env),
            cwd=cwd,
            stdout=output,
            stderr=None if output is None else subprocess.STDOUT,
            shell=False,
            start_new_session=new_session,
        )
    except FileNotFoundError as exc:
        raise SlurmUnavailable(f"{command[0]} not found: is it installed?") from exc
