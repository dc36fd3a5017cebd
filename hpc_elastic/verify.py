"""Checking that a training script with N ESTs ends in bitwise-identical states under several process counts
(and resized mid-run), through the one runtime and launcher (``hpc-elastic verify-determinism``).

Each run has its own job directory; the script must commit its final state (the bundled example does), and the
fingerprint of that checkpoint (:func:`hpc_elastic.est.checkpoint.fingerprint`: parameters, optimizer state and
every EST's context) is compared.  ``resize_at`` K stops a run of M processes at step K through the control
protocol (``control/stop`` with ``at_step``), then continues the same job directory on the next M.  Locally the
processes start with the launcher's ``local`` mode (:class:`LocalRunner`); with ``submit`` every case runs as a
Slurm job through ``hpc-elastic submit``'s batch script and the real wrapper (:class:`SlurmRunner`).

:class:`VerifyConfig` is one check (its options, checked when it is built); :func:`run_verification` runs it.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from hpc_elastic.checkpoint import CheckpointStore
from hpc_elastic.collective import Backend
from hpc_elastic.env import read_environment
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est.checkpoint import Fingerprint, fingerprint
from hpc_elastic.est.detsum import MAX_ESTS
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.jobdir import JobDir, StopReason, StopRequest
from hpc_elastic.launch.batch import render_batch_script
from hpc_elastic.launch.spec import SubmitSpec
from hpc_elastic.launch.submission import check_against_cluster, wrapper_argv
from hpc_elastic.launch.workers import Launcher, WorkerStep, start_workers, unavailable_reason
from hpc_elastic.slurm import Job, JobState, SlurmClient, commands, connect
from hpc_elastic.slurm.commands import JobAction

DEFAULT_PROCS = "1,2,4"


def parse_procs(text: str, workers: int) -> list[int]:
    out: list[int] = []
    for raw in text.split(","):
        tok = raw.strip()
        if not tok:
            continue
        try:
            m = int(tok)
        except ValueError:
            raise ValueError(f"--procs must be a comma-separated list of integers, got {text!r}") from None
        if not 1 <= m <= workers:
            raise ValueError(f"--procs value {m} is outside [1, {workers}] (M processes for N={workers} workers)")
        out.append(m)
    if not out:
        raise ValueError(f"--procs lists no process count: {text!r}")
    return out


@dataclass(frozen=True)
class Outcome:
    label: str
    procs: str
    found: Fingerprint
    wall_s: float


def final_fingerprint(job_dir: JobDir) -> Fingerprint:
    """The fingerprint of the newest valid checkpoint of a run's job directory."""
    ckpt = CheckpointStore(job_dir.checkpoints).latest()
    if ckpt is None:
        raise HpcElasticError(f"{job_dir.path} holds no checkpoint: the script must commit its final state")
    return fingerprint(ckpt)


def request_stop_at(job_dir: JobDir, step: int) -> None:
    """Ask the job of ``job_dir`` to stop (reason ``resize``) once it reaches ``step`` (a request that stands until
    a checkpoint of that step is acknowledged)."""
    job_dir.prepare().request_stop(StopRequest(StopReason.RESIZE, time.time(), step))


def acknowledged_step(job_dir: JobDir) -> int:
    """The step the job's workers acknowledged a checkpoint of (:class:`HpcElasticError` when there is none)."""
    ack = job_dir.read_ack()
    if ack is None:
        raise HpcElasticError(f"the run in {job_dir.path} did not acknowledge its stop")
    return ack.step


class Runner(Protocol):
    """Runs the cases of a check: a job of ``procs`` processes to its end, or stopped at a step and continued on
    another number of processes.  Returns the job directory."""

    def fixed(self, name: str, procs: int) -> JobDir: ...

    def resized(self, name: str, procs: int, then: int, at_step: int) -> JobDir: ...


class LocalRunner:
    """Each case as processes on this machine (the launcher's ``local`` mode), in ``root/<name>``."""

    def __init__(
        self,
        root: Path,
        command: tuple[str, ...],
        *,
        backend: Backend,
        workers: int,
        level: DeterminismLevel,
        timeout_s: float,
    ) -> None:
        self.root = root
        self.command = command
        self.backend = backend
        self.workers = workers
        self.level = level
        self.timeout_s = timeout_s

    def _run(self, job_dir: JobDir, procs: int) -> None:
        job_dir.prepare()
        step = WorkerStep(
            command=self.command,
            ntasks=procs,
            num_ests=self.workers,
            job_dir=job_dir.path,
            backend=self.backend,
            launcher=Launcher.LOCAL,
            level=self.level,
        )
        code = start_workers(step, logs=job_dir.logs).wait(self.timeout_s)
        if code != 0:
            raise HpcElasticError(
                f"the run on {procs} processes in {job_dir.path} failed (exit {code}){_tail(job_dir.logs)}"
            )

    def fixed(self, name: str, procs: int) -> JobDir:
        job_dir = JobDir(self.root / name)
        self._run(job_dir, procs)
        return job_dir

    def resized(self, name: str, procs: int, then: int, at_step: int) -> JobDir:
        job_dir = JobDir(self.root / name)
        request_stop_at(job_dir, at_step)
        self._run(job_dir, procs)
        if acknowledged_step(job_dir) != at_step:
            raise HpcElasticError(f"the run in {job_dir.path} did not stop at step {at_step}")
        job_dir.set_aside(0)  # what the wrapper does before the job's next incarnation
        self._run(job_dir, then)
        return job_dir


class SlurmRunner:
    """Each case as a Slurm job through ``hpc-elastic submit``'s batch script and the wrapper: ``procs`` GPUs (one
    process each) on a GPU partition, ``procs`` processes on a CPU one.  A resize is what the scheduler plugin
    does: a stop at the step, the wrapper's requeue, the pending job's new size."""

    def __init__(self, slurm: SlurmClient, base: SubmitSpec, wrapper: list[str], timeout_s: float) -> None:
        self.slurm = slurm
        self.base = base
        self.wrapper = wrapper
        self.timeout_s = timeout_s

    def _spec(self, name: str, procs: int) -> SubmitSpec:
        if self.base.gpus:
            return replace(self.base, job_name=name, gpus=procs, min_gpus=None, max_gpus=None)
        return replace(self.base, job_name=name, procs=procs)

    def _submit(self, name: str, procs: int, *options: str) -> tuple[int, JobDir]:
        spec = self._spec(name, procs)
        job_id = self.slurm.submit(options=options, script_text=render_batch_script(spec, self.wrapper))
        return job_id, JobDir.of(spec.ckpt_root, spec.name, job_id)

    def _wait(self, job_id: int, what: str, done: Callable[[Job], bool]) -> Job:
        """Poll squeue until ``done(job)`` (a finished job stays there for MinJobAge); cancel it on timeout."""
        deadline = time.monotonic() + self.timeout_s
        last = None
        while time.monotonic() < deadline:
            found = self.slurm.jobs([job_id])
            if not found:
                raise HpcElasticError(f"job {job_id} left the queue before {what}")
            last = found[0]
            if done(last):
                return last
            if not last.state.is_active:
                raise HpcElasticError(f"job {job_id} ended {last.state.value} before {what}")
            time.sleep(1.0)
        self.slurm.cancel([job_id])
        seen = ""
        if last is not None:
            reason = f" ({last.pending_reason})" if last.pending_reason else ""
            seen = f"; it was {last.state.value}{reason}"
        raise HpcElasticError(f"job {job_id}: no {what} within {self.timeout_s:.0f} s (cancelled{seen})")

    def fixed(self, name: str, procs: int) -> JobDir:
        job_id, job_dir = self._submit(name, procs)
        self._wait(job_id, "completion", lambda j: j.state is JobState.COMPLETED)
        return job_dir

    def resized(self, name: str, procs: int, then: int, at_step: int) -> JobDir:
        job_id, job_dir = self._submit(name, procs, "--hold")
        request_stop_at(job_dir, at_step)  # before it runs: the wrapper keeps a stop for a step until it is acked
        self.slurm.act(JobAction.RELEASE, [job_id])
        self._wait(job_id, "the requeue after the stop", lambda j: j.restart_count >= 1 and j.state.is_pending)
        if acknowledged_step(job_dir) != at_step:  # read before the next start sets the acknowledgement aside
            self.slurm.cancel([job_id])
            raise HpcElasticError(f"job {job_id} did not stop at step {at_step}")
        cpus, per_task = then * self.base.cpus_per_worker, 1 if self.base.gpus else 0
        self.slurm.update_job(job_id, commands.size_fields(then, cpus, self.base.gpu_type, gpus_per_task=per_task))
        self._wait(job_id, "completion", lambda j: j.state is JobState.COMPLETED)
        return job_dir


def _tail(logs: Path, lines: int = 3) -> str:
    out: list[str] = []
    for log in sorted(logs.glob("*.log")):
        text = log.read_text(errors="replace").strip().splitlines()
        out.extend(f"[{log.name}] {line}" for line in text[-lines:])
    return (": " + " | ".join(out[-lines:])) if out else ""


def bundled_example() -> str:
    """The path of the bundled training script (:mod:`hpc_elastic.est.example`), found without importing it."""
    spec = importlib.util.find_spec("hpc_elastic.est.example")
    if spec is None or spec.origin is None:
        raise HpcElasticError("the bundled example hpc_elastic.est.example is not installed")
    return spec.origin


def verify(runner: Runner, counts: list[int], resize_at: int | None, say: Callable[[str], None]) -> list[Outcome]:
    """The fixed-M runs, then each resize from one M of ``counts`` to the next; every outcome is reported by
    ``say`` as it comes (the first is the reference)."""
    outcomes: list[Outcome] = []

    def record(label: str, shown: str, job_dir: JobDir, started: float) -> None:
        outcomes.append(Outcome(label, shown, final_fingerprint(job_dir), time.monotonic() - started))
        ref, o = outcomes[0], outcomes[-1]
        verdict = "reference" if len(outcomes) == 1 else ("match" if _same(ref, o) else "MISMATCH")
        found = o.found
        say(f"{o.label:<18} {o.procs:>6}  step {found.step:<5} {found.params_sha256}  {verdict}  ({o.wall_s:.1f} s)")

    for m in counts:
        started = time.monotonic()
        record(f"fixed M={m}", str(m), runner.fixed(f"fixed-m{m}", m), started)
    if resize_at is not None:
        for m, m2 in list(itertools.pairwise(counts)) or [(counts[0], counts[0])]:
            started = time.monotonic()
            job_dir = runner.resized(f"resize-m{m}-m{m2}", m, m2, resize_at)
            record(f"resize@{resize_at} {m}->{m2}", f"{m}->{m2}", job_dir, started)
    return outcomes


def _same(a: Outcome, b: Outcome) -> bool:
    return (a.found.step, a.found.params_sha256, a.found.state_sha256) == (
        b.found.step,
        b.found.params_sha256,
        b.found.state_sha256,
    )


@dataclass(frozen=True)
class VerifyConfig:
    """One check: ``script`` (``None``: the bundled example) run as ``script --steps=<steps> args`` with ``workers``
    ESTs on each process count of ``procs`` (``"1,2,4"``), and with ``resize_at`` also stopped there and continued
    on the next count.  ``ValueError`` naming the bad option and its value."""

    script: Path | None = None
    args: tuple[str, ...] = ()
    workers: int = 4
    procs: str = DEFAULT_PROCS
    backend: Backend = Backend.TORCH
    steps: int = 8
    resize_at: int | None = None
    level: DeterminismLevel = DeterminismLevel.D1
    #: seconds one run may take
    timeout_s: float = 600.0
    #: every case as a Slurm job through the wrapper (on ``partition``, default: the cluster's default one)
    submit: bool = False
    partition: str | None = None
    gpu_type: str | None = None
    #: keep every run's job directory here (default: a temporary directory, removed after the check; with
    #: ``submit`` a new one on the shared filesystem, kept)
    workdir: Path | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= MAX_ESTS:
            raise ValueError(f"--workers must be between 1 and {MAX_ESTS}, got {self.workers}")
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"--timeout must be a finite number of seconds > 0, got {self.timeout_s}")
        if self.resize_at is not None and self.steps < 2:
            raise ValueError(f"--resize-at needs --steps 2 or more (a step before the last), got {self.steps}")
        if self.resize_at is not None and not 0 < self.resize_at < self.steps:
            raise ValueError(
                f"--resize-at must be in [1, {self.steps - 1}] for --steps {self.steps}, got {self.resize_at}"
            )
        if self.script is not None and not self.script.is_file():
            raise ValueError(f"training script {self.script} does not exist")
        parse_procs(self.procs, self.workers)
        if not self.submit and (self.partition is not None or self.gpu_type is not None):
            raise ValueError("--partition and --gpu-type go with --submit")

    @property
    def counts(self) -> list[int]:
        """The process counts M of ``procs``, in order."""
        return parse_procs(self.procs, self.workers)


@dataclass(frozen=True)
class VerifyReport:
    """The outcomes of a check, the reference (the first) first."""

    outcomes: tuple[Outcome, ...]

    @property
    def reference(self) -> Outcome:
        return self.outcomes[0]

    @property
    def mismatches(self) -> list[Outcome]:
        """The outcomes whose final state differs from the reference's."""
        return [o for o in self.outcomes[1:] if not _same(self.reference, o)]


def run_verification(config: VerifyConfig, say: Callable[[str], None]) -> VerifyReport:
    """Run the check of ``config``: choose the workdir, build the runner (with ``submit``: check the partition
    against the cluster before the workdir is created), report the setting and every outcome through ``say`` as
    it comes, and remove a temporary workdir at the end."""
    reason = None if config.submit else unavailable_reason(config.backend)
    if reason is not None:
        raise HpcElasticError(f"backend {config.backend.value} cannot run here: {reason}")
    target = Path(config.script.resolve()) if config.script is not None else Path(bundled_example())
    script_args = (f"--steps={config.steps}", *config.args)
    if config.workdir is not None:
        root = config.workdir
    elif config.submit:  # every node must see it: the shared filesystem
        root = read_environment().gpfs_root / "verify" / f"{int(time.time())}-{secrets.token_hex(3)}"
    else:
        root = Path(tempfile.mkdtemp(prefix="hpc-elastic-verify-"))
    runner: Runner
    if config.submit:
        runner = _slurm_runner(config, target, script_args, root)
    else:
        command = (sys.executable, str(target), *script_args)
        runner = LocalRunner(
            root,
            command,
            backend=config.backend,
            workers=config.workers,
            level=config.level,
            timeout_s=config.timeout_s,
        )
    root.mkdir(parents=True, exist_ok=True)  # once every option and the cluster agreed
    counts = config.counts
    say(
        f"verify-determinism: N={config.workers} ESTs, procs {','.join(map(str, counts))}, {config.steps} steps, "
        f"{config.backend.value}, level {config.level.value}, "
        f"{'as Slurm jobs' if config.submit else 'local processes'}, workdir {root}"
    )
    say(f"{'run':<18} {'procs':>6}  {'step':<10} {'sha256 of final parameters':<64}  verdict")
    try:
        outcomes = verify(runner, counts, config.resize_at, say)
    finally:
        if config.workdir is None and not config.submit:
            shutil.rmtree(root, ignore_errors=True)
    return VerifyReport(tuple(outcomes))


def _slurm_runner(config: VerifyConfig, target: Path, script_args: tuple[str, ...], root: Path) -> SlurmRunner:
    """The runner of ``config`` on this cluster's partition (``ValueError`` when the cluster has no such one,
    :func:`check_against_cluster`'s errors when it cannot run the cases)."""
    slurm = connect(read_environment())
    partitions = {p.name: p for p in slurm.partitions()}
    chosen = config.partition or next((name for name, p in partitions.items() if p.default), None)
    if chosen is None or chosen not in partitions:
        raise ValueError(f"no partition {chosen!r} on this cluster")
    has_gpus = any(n.gpus.total > 0 and chosen in n.partitions for n in slurm.nodes())
    base = SubmitSpec(
        script=target,
        args=script_args,
        gpus=1 if has_gpus else 0,
        procs=None if has_gpus else 1,
        gpu_type=config.gpu_type,
        partition=chosen,
        backend=config.backend,
        workers=config.workers,
        level=config.level,
        ckpt_root=root,
        python=sys.executable,
    )
    check_against_cluster(base, slurm)
    return SlurmRunner(slurm, base, wrapper_argv(sys.executable), config.timeout_s)
