"""The daemon's story on a real Slurm cluster: a mix of short and long training jobs, with and without the daemon.

Used by ``make demo`` (``scripts/demo.py``) and the integration tests. Jobs are submitted through
``hpc-elastic submit`` and run ``wrappers/examples/train_mlp.py`` (a real training loop that checkpoints on a stop
request and prints the sha256 of its final parameters). A plain ``sbatch`` filler job, which the daemon does not
manage, holds all but ``free_gpus`` GPUs of the partition, so that the mix competes for a few GPUs on a small
machine. The daemon runs as a separate process (``python -m slurm_plugin.cli``) scoped to the mix by
``job_name_pattern``, so other people's jobs on the cluster are left alone.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpc_elastic.slurm import Job, JobState, SlurmClient, SlurmError

REPO = Path(__file__).resolve().parent.parent
TRAINER = REPO / "wrappers" / "examples" / "train_mlp.py"


class ScenarioError(RuntimeError):
    """The mix could not run to its end (timeout, a job failed, the filler could not start)."""


@dataclass(frozen=True)
class MixJob:
    """One training job of the mix: ``steps`` optimizer steps of train_mlp, ``step_delay`` seconds each."""

    name: str
    gpus: int
    steps: int
    step_delay: float


@dataclass(frozen=True)
class MixConfig:
    partition: str = "gpu-v100"
    gpu_type: str = "v100"
    filler_gres_per_node: int = 3  # of 4 GPUs per node, on 2 nodes: 2 GPUs stay free for the mix
    filler_nodes: int = 2
    long: MixJob = MixJob("long", 2, 200, 0.3)
    short: tuple[MixJob, ...] = (MixJob("short1", 1, 20, 0.2), MixJob("short2", 1, 20, 0.2))
    #: daemon settings: a threshold low enough that the long job is demoted after ~30 s on 2 GPUs (Tiresias
    #: §3.2.3: a job leaves Q1 when W_J x t_J crosses it), high enough for a 1-GPU short job to finish in Q1
    #: (starting two torch workers takes ~15 s on a loaded 2-core machine; that time counts as service too)
    threshold_gpu_s: float = 60.0
    min_run_time_s: float = 5.0
    grace_s: float = 60.0
    requeue_wait_s: float = 5.0
    interval_s: float = 3.0
    timeout_s: float = 480.0


@dataclass
class JobOutcome:
    name: str
    job_id: int
    submit: float
    end: float
    jct: float
    preemptions: int
    resumed_from_checkpoint: bool
    sha256: str
    start_step: int


@dataclass
class MixResult:
    plugin: bool
    workdir: str
    jobs: dict[str, JobOutcome] = field(default_factory=dict)
    #: attained service (GPU-s) of the long job in the daemon's store just before it was killed and after restart
    attained_before_kill: float | None = None
    attained_after_restart: float | None = None
    daemon_actions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def avg_jct(self) -> float:
        return sum(j.jct for j in self.jobs.values()) / max(1, len(self.jobs))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["avg_jct"] = self.avg_jct
        return out


def write_config(workdir: Path, prefix: str, mix: MixConfig) -> Path:
    state = workdir / "state"
    state.mkdir(parents=True, exist_ok=True)
    path = workdir / "hpc-elastic.toml"
    path.write_text(
        f'state_dir = "{state}"\njob_name_pattern = "^{prefix}-"\nckpt_roots = ["{workdir}"]\n'
        f"interval_s = {mix.interval_s}\nevent_poll_s = 1\nstop_poll_s = 1\n"
        f"[tiresias]\nthresholds = [{mix.threshold_gpu_s}]\n"
        f"[preemption]\nmin_run_time_s = {mix.min_run_time_s}\ngrace_s = {mix.grace_s}\n"
        f"requeue_wait_s = {mix.requeue_wait_s}\n[metrics]\nenabled = false\n"
    )
    return path


class DaemonProcess:
    """``hpc-elastic-sched`` as a child process, its log appended to ``log``."""

    def __init__(self, config: Path, log: Path) -> None:
        self.config, self.log = config, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "slurm_plugin.cli", "--config", str(self.config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,
            )

    def kill(self, sig: int = signal.SIGKILL) -> int | None:
        """Send ``sig`` and wait for the exit (SIGKILL after 20 s); its exit status, None when none was running."""
        code = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                code = self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait()
        self.proc = None
        return code

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def submit_training(workdir: Path, mix: MixConfig, prefix: str, job: MixJob) -> int:
    result = workdir / f"{job.name}.result.json"
    argv = [
        sys.executable,
        "-m",
        "hpc_elastic",
        "submit",
        str(TRAINER),
        f"--gpus={job.gpus}",
        f"--gpu-type={mix.gpu_type}",
        f"--partition={mix.partition}",
        f"--job-name={prefix}-{job.name}",
        f"--ckpt-root={workdir}",
        "--",
        f"--steps={job.steps}",
        f"--step-delay={job.step_delay}",
        f"--result={result}",
    ]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60, cwd=REPO)
    return int(out.stdout.strip())


def submit_filler(slurm: SlurmClient, workdir: Path, mix: MixConfig, prefix: str) -> int:
    return slurm.submit(
        script_text="#!/bin/bash\nsleep 3600\n",
        options=[
            f"--job-name={prefix}-filler",
            f"--partition={mix.partition}",
            f"--nodes={mix.filler_nodes}",
            f"--gres=gpu:{mix.gpu_type}:{mix.filler_gres_per_node}",
            f"--output={workdir}/filler-%j.out",
        ],
    )


def wait_until(what: str, probe: Callable[[], Any], deadline: float, every_s: float = 0.5) -> Any:
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise ScenarioError(f"timed out waiting for {what}")
        time.sleep(every_s)


def _state(slurm: SlurmClient, job_id: int) -> Job | None:
    with contextlib.suppress(SlurmError):
        found = slurm.jobs([job_id])
        return found[0] if found else None
    return None


def _first_submit(slurm: SlurmClient, job_id: int) -> float:
    """When the job was submitted, read at once: Slurm resets a job's submit time when it is requeued, so the
    submit time it reports at the end is that of the last requeue, not the user's submission."""
    job = _state(slurm, job_id)
    if job is not None and job.submit_time is not None and job.restart_count == 0:
        return job.submit_time.timestamp()
    return time.time()


def _attained(workdir: Path, job_id: int) -> float | None:
    try:
        doc = json.loads((workdir / "state" / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return next((float(j["attained_gpu_s"]) for j in doc["jobs"] if j["job_id"] == job_id), None)


def cancel_active(slurm: SlurmClient, ids: Iterable[int], timeout_s: float = 120.0) -> list[int]:
    """Cancel those of ``ids`` still pending, running or completing and wait until they have ended: what a
    scenario or a test leaves must not hold GPUs for the next one. Only the active ones are named to scancel
    (:meth:`~hpc_elastic.slurm.CliSlurm.cancel` refuses a list with a job slurmctld has forgotten, MinJobAge
    after its end, and would cancel none); a failed squeue or scancel is tried again. The ids still active at
    ``timeout_s``."""
    active = sorted(set(ids))
    deadline = time.monotonic() + timeout_s
    while active:
        with contextlib.suppress(SlurmError):  # a loaded controller: look again
            active = [job.job_id for job in slurm.jobs(active) if job.state.is_active]
            if active:
                slurm.cancel(active)
        if not active or time.monotonic() > deadline:
            break
        time.sleep(2.0)
    return active


@contextlib.contextmanager
def _cleanup(slurm: SlurmClient, ids: list[int], daemon: DaemonProcess | None) -> Iterator[None]:
    try:
        yield
    finally:
        if daemon is not None:
            daemon.kill(signal.SIGTERM)
        cancel_active(slurm, ids)


def run_mix(
    slurm: SlurmClient,
    root: Path,
    mix: MixConfig,
    *,
    plugin: bool,
    restart_daemon: bool = False,
    say: Callable[[str], None] = lambda line: None,
) -> MixResult:
    """Run the mix once; ``restart_daemon`` kills (SIGKILL) and restarts the daemon after the first preemption."""
    prefix = f"mix{uuid.uuid4().hex[:6]}"
    workdir = root / prefix
    workdir.mkdir(parents=True)
    result = MixResult(plugin=plugin, workdir=str(workdir))
    daemon = DaemonProcess(write_config(workdir, prefix, mix), workdir / "daemon.log") if plugin else None
    ids: list[int] = []
    deadline = time.monotonic() + mix.timeout_s
    with _cleanup(slurm, ids, daemon):
        filler = submit_filler(slurm, workdir, mix, prefix)
        ids.append(filler)
        wait_until("the filler job to start", lambda: (j := _state(slurm, filler)) and j.state.is_running, deadline)
        if daemon is not None:
            daemon.start()
            say(f"daemon started (log {daemon.log})")
        long_id = submit_training(workdir, mix, prefix, mix.long)
        ids.append(long_id)
        names = {long_id: mix.long.name}
        submitted = {long_id: _first_submit(slurm, long_id)}
        say(f"submitted {mix.long.name} ({mix.long.gpus} GPUs, {mix.long.steps} steps): job {long_id}")
        wait_until(f"{mix.long.name} to run", lambda: (j := _state(slurm, long_id)) and j.state.is_running, deadline)
        for job in mix.short:
            job_id = submit_training(workdir, mix, prefix, job)
            ids.append(job_id)
            names[job_id] = job.name
            submitted[job_id] = _first_submit(slurm, job_id)
            say(f"submitted {job.name} ({job.gpus} GPUs, {job.steps} steps): job {job_id}")
        restarted = not restart_daemon
        seen_restarts = 0
        ended: dict[int, Job] = {}
        while len(ended) < len(names):
            if time.monotonic() > deadline:
                raise ScenarioError(f"the mix did not finish within {mix.timeout_s:.0f}s (workdir {workdir})")
            for job_id, name in names.items():
                current = None if job_id in ended else _state(slurm, job_id)
                if current is None:
                    continue
                if current.restart_count > seen_restarts and job_id == long_id:
                    seen_restarts = current.restart_count
                    say(f"{name} requeued after a checkpoint (restart {current.restart_count})")
                if current.state is JobState.COMPLETED:
                    ended[job_id] = current
                    say(f"{name} completed")
                elif not current.state.is_active:
                    raise ScenarioError(f"job {job_id} ({name}) ended {current.state.value} (workdir {workdir})")
            if daemon is not None and not daemon.alive:
                raise ScenarioError(f"the daemon exited (log {daemon.log})")
            if not restarted and daemon is not None and seen_restarts:
                _restart(daemon, workdir, long_id, deadline, result)
                say("daemon killed (SIGKILL) after the preemption and restarted; it went on from its store")
                restarted = True
            time.sleep(1.0)
        for job_id, done in ended.items():
            result.jobs[names[job_id]] = outcome(workdir, names[job_id], done, submitted[job_id])
        if daemon is not None:
            with contextlib.suppress(OSError, ValueError):
                doc = json.loads((workdir / "state" / "state.json").read_text())
                result.daemon_actions = list(doc.get("recent_actions", []))
    return result


def _restart(daemon: DaemonProcess, workdir: Path, job_id: int, deadline: float, result: MixResult) -> None:
    """SIGKILL the daemon mid-run and start it again; record the job's attained service around it."""
    result.attained_before_kill = _attained(workdir, job_id)
    daemon.kill(signal.SIGKILL)
    state = workdir / "state" / "state.json"
    before = state.stat().st_mtime
    daemon.start()
    wait_until("a pass of the restarted daemon", lambda: state.stat().st_mtime > before, deadline)
    result.attained_after_restart = _attained(workdir, job_id)


def outcome(workdir: Path, name: str, job: Job, submitted: float) -> JobOutcome:
    """The job's outcome; JCT = Slurm's end time - ``submitted`` (the first submission, see _first_submit)."""
    res = json.loads((workdir / f"{name}.result.json").read_text())
    if res.get("stopped"):
        raise ScenarioError(f"{name}: the last result is of a stopped run: {res}")
    if job.end_time is None:
        raise ScenarioError(f"{name}: Slurm reports no end time")
    submit, end = submitted, job.end_time.timestamp()
    return JobOutcome(
        name=name,
        job_id=job.job_id,
        submit=submit,
        end=end,
        jct=end - submit,
        preemptions=job.restart_count,
        resumed_from_checkpoint=res.get("restored_from") is not None and int(res.get("start_step", 0)) > 0,
        sha256=str(res["sha256"]),
        start_step=int(res.get("start_step", 0)),
    )


def end_order(result: MixResult) -> list[str]:
    """Job names by completion time (Slurm's end time; ties by name)."""
    return [j.name for j in sorted(result.jobs.values(), key=lambda j: (j.end, j.name))]


def uninterrupted(runs: Sequence[MixResult], name: str) -> str | None:
    """The final parameter sha of ``name`` in a run where it was never preempted."""
    for run in runs:
        job = run.jobs.get(name)
        if job is not None and job.preemptions == 0:
            return job.sha256
    return None
