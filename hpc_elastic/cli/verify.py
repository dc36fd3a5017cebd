"""``hpc-elastic verify-determinism``: run a training script with N ESTs under several process counts (and resized
mid-run) through the one runtime and launcher, and check that the final states are bitwise identical.

Each run has its own job directory; the script must commit its final state (the bundled example does), and the
fingerprint of that checkpoint (:func:`hpc_elastic.est.checkpoint.fingerprint`: parameters, optimizer state and
every EST's context) is compared.  ``--resize-at K`` stops a run of M processes at step K through the control
protocol (``control/stop`` with ``at_step``), then continues the same job directory on the next M.  Locally the
processes start with the launcher's ``local`` mode; ``--submit`` runs every case as a Slurm job through
``hpc-elastic submit``'s batch script and the real wrapper.
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

import click

from hpc_elastic.checkpoint import CheckpointStore
from hpc_elastic.collective import Backend
from hpc_elastic.env import read_environment
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.est.checkpoint import Fingerprint, fingerprint
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


@click.command("verify-determinism", context_settings={"ignore_unknown_options": True})
@click.argument("script", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--workers", "-n", type=int, default=4, show_default=True, help="N, the ESTs (logical workers).")
@click.option("--procs", default=DEFAULT_PROCS, show_default=True, help="Process counts M to run, e.g. 1,2,4.")
@click.option(
    "--backend", type=click.Choice([b.value for b in Backend]), default=Backend.TORCH.value, show_default=True
)
@click.option("--steps", type=int, default=8, show_default=True, help="Global steps of every run (--steps K).")
@click.option("--resize-at", type=int, default=None, help="Also stop each run at this step, go on with the next M.")
@click.option(
    "--level",
    type=click.Choice([lvl.value for lvl in DeterminismLevel]),
    default=DeterminismLevel.D1.value,
    show_default=True,
)
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds one run may take.")
@click.option("--submit", is_flag=True, help="Run every case as a Slurm job through the wrapper (not locally).")
@click.option("--partition", default=None, help="With --submit: the partition (GPU partitions: one GPU per process).")
@click.option("--gpu-type", default=None, help="With --submit: the GPU type.")
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep every run's job directory here (checkpoints, logs).",
)
def verify_determinism(
    *,
    script: Path | None,
    args: tuple[str, ...],
    workers: int,
    procs: str,
    backend: str,
    steps: int,
    resize_at: int | None,
    level: str,
    timeout: float,
    submit: bool,
    partition: str | None,
    gpu_type: str | None,
    workdir: Path | None,
) -> None:
    """Run SCRIPT (default: the bundled example with dropout, BatchNorm and an augmenting loader) as
    ``SCRIPT --steps K ARGS`` with N ESTs on each M of --procs, print the sha256 of the final parameters of every
    run, and exit 0 only when all final states match.  ARGS follow ``--`` (``-- --loader-workers 1`` passes them
    to the bundled example)."""
    if script is not None and str(script).startswith("-"):  # `verify-determinism -- --opt` : the bundled example's
        script, args = None, (str(script), *args)
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"--timeout must be a finite number of seconds > 0, got {timeout}")
    if resize_at is not None and not 0 < resize_at < steps:
        raise ValueError(f"--resize-at must be in [1, {steps - 1}] for --steps {steps}, got {resize_at}")
    if script is not None and not script.is_file():
        raise ValueError(f"training script {script} does not exist")
    counts = parse_procs(procs, workers)
    be = Backend.parse(backend)
    lvl = DeterminismLevel.parse(level)
    if not submit and (partition is not None or gpu_type is not None):
        raise ValueError("--partition and --gpu-type go with --submit")
    reason = None if submit else unavailable_reason(be)
    if reason is not None:
        raise HpcElasticError(f"backend {be.value} cannot run here: {reason}")
    target = Path(script.resolve()) if script is not None else Path(bundled_example())
    script_args = (f"--steps={steps}", *args)
    if workdir is not None:
        root = workdir
    elif submit:  # every node must see it: the shared filesystem
        root = read_environment().gpfs_root / "verify" / f"{int(time.time())}-{secrets.token_hex(3)}"
    else:
        root = Path(tempfile.mkdtemp(prefix="hpc-elastic-verify-"))
    runner: Runner
    if submit:
        slurm = connect(read_environment())
        partitions = {p.name: p for p in slurm.partitions()}
        chosen = partition or next((name for name, p in partitions.items() if p.default), None)
        if chosen is None or chosen not in partitions:
            raise ValueError(f"no partition {chosen!r} on this cluster")
        has_gpus = any(n.gpus.total > 0 and chosen in n.partitions for n in slurm.nodes())
        base = SubmitSpec(
            script=target,
            args=script_args,
            gpus=1 if has_gpus else 0,
            procs=None if has_gpus else 1,
            gpu_type=gpu_type,
            partition=chosen,
            backend=be,
            workers=workers,
            level=lvl,
            ckpt_root=root,
            python=sys.executable,
        )
        check_against_cluster(base, slurm)
        runner = SlurmRunner(slurm, base, wrapper_argv(sys.executable), timeout)
    else:
        command = (sys.executable, str(target), *script_args)
        runner = LocalRunner(root, command, backend=be, workers=workers, level=lvl, timeout_s=timeout)
    root.mkdir(parents=True, exist_ok=True)  # once every option and the cluster agreed
    click.echo(
        f"verify-determinism: N={workers} ESTs, procs {','.join(map(str, counts))}, {steps} steps, "
        f"{be.value}, level {lvl.value}, {'as Slurm jobs' if submit else 'local processes'}, workdir {root}"
    )
    click.echo(f"{'run':<18} {'procs':>6}  {'step':<10} {'sha256 of final parameters':<64}  verdict")
    try:
        outcomes = verify(runner, counts, resize_at, click.echo)
    finally:
        if workdir is None and not submit:
            shutil.rmtree(root, ignore_errors=True)
    bad = [o for o in outcomes[1:] if not _same(outcomes[0], o)]
    if bad:
        click.echo(f"MISMATCH: {len(bad)} of {len(outcomes)} runs differ from the reference ({outcomes[0].label})")
        raise click.exceptions.Exit(1)
    click.echo(f"OK: all {len(outcomes)} runs ended in bitwise-identical states")
