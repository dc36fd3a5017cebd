"""EasyScale's grow-and-shrink story on a real Slurm cluster, with the daemon under ``tiresias-las+easyscale``.

Used by ``make demo``'s second act (``scripts/demo.py``); the daemon configuration of the resize stories
(:func:`write_resize_config`) and the uninterrupted reference run (:func:`reference_params_sha`) are shared with the
integration tests. The story (the layout of the daemon's cross-type integration test): plain filler jobs, which the
daemon does not manage, hold all of the ``gpu`` partition's GPUs but node2's last 2 a100 and node3's last 2 v100; the
bundled example (``hpc_elastic/est/example.py``, the Linear/ReLU model D2 covers) with N logical workers (ESTs) at
level D2 is submitted through ``hpc-elastic submit`` without a GPU type, elastic between a minimum and a maximum of
GPUs, and starts on the 2 a100. Once it trains, the filler on node3's 2 v100 ends and the daemon starts: with idle
GPUs and nothing waiting, EasyScale's proposals (§3.4, Role 2) grow it, across types when the planner's plan spans
them (Eq. 1d); then a rigid gang job arrives and 2D-LAS, counting the elastic job at its minimum, lets it in: the
elastic job shrinks. Both run to their end, and the elastic job's final parameters are compared with those of one
uninterrupted 1-process run of the same N at the same level.

The story polls Slurm every second while it runs; each poll's view of the jobs is kept (:mod:`slurm_plugin.timeline`)
so that the GPUs of each type each job held can be drawn over time, whatever the daemon decided (one type or
several). The daemon runs as a separate process scoped to the story's jobs by ``job_name_pattern``: other people's
jobs on the cluster are left alone, and the story cancels its own jobs when it ends, however it ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from hpc_elastic.checkpoint import CheckpointStore
from hpc_elastic.est.checkpoint import fingerprint
from hpc_elastic.est.levels import DeterminismLevel
from hpc_elastic.jobdir import output_path
from hpc_elastic.launch.workers import Launcher, WorkerStep, start_workers
from hpc_elastic.slurm import Job, JobState, SlurmClient, SlurmError
from slurm_plugin.daemon import release_held_nodes
from slurm_plugin.scenario import DaemonProcess, ScenarioError, cancel_active
from slurm_plugin.timeline import LossRecord, Sample, loss_by_step, parse_loss_line

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "hpc_elastic" / "est" / "example.py"
SHA = re.compile(r"final-params-sha256 ([0-9a-f]{64})")
T = TypeVar("T")


def write_config(workdir: Path, prefix: str, extra: str, *, top: str = "") -> Path:
    """A daemon configuration that manages only the jobs named ``<prefix>-...`` (state under ``workdir``);
    ``top``: more top-level keys, ``extra``: more sections (TOML text)."""
    state = workdir / "state"
    state.mkdir(exist_ok=True)
    path = workdir / "sched.toml"
    path.write_text(
        f'state_dir = "{state}"\njob_name_pattern = "^{prefix}-"\nckpt_roots = ["{workdir}"]\n{top}'
        f"[metrics]\nenabled = false\n{extra}"
    )
    return path


def write_resize_config(workdir: Path, prefix: str, *, grace_s: int, policy: str | None = None) -> Path:
    """:func:`write_config` for the resize stories: one MLFQ queue, no preemption, resizes on, passes every 2 s;
    ``policy``: the daemon's policy when not the default."""
    top = (f'policy = "{policy}"\n' if policy else "") + "interval_s = 2\nevent_poll_s = 1\nstop_poll_s = 1\n"
    return write_config(
        workdir,
        prefix,
        "[tiresias]\nthresholds = [1e9]\n[preemption]\nenabled = false\nmin_run_time_s = 0\n"
        f"grace_s = {grace_s}\nrequeue_wait_s = 5\n[resize]\nenabled = true\n",
        top=top,
    )


def reference_params_sha(
    job_dir: Path,
    command: Sequence[str],
    *,
    workers: int,
    level: DeterminismLevel | None = None,
    timeout_s: float = 300,
) -> str:
    """The uninterrupted run: ``command`` (a training script that commits its final state) on one local process
    with ``workers`` ESTs in ``job_dir``, outside Slurm; the sha256 of its final parameters (the same bits on any
    number of processes: the runtime's promise)."""
    step = WorkerStep(
        command=tuple(command), ntasks=1, num_ests=workers, job_dir=job_dir, launcher=Launcher.LOCAL, level=level
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPC_ELASTIC_"))}
    code = start_workers(step, environ=env, logs=job_dir / "logs").wait(timeout_s)
    if code != 0:
        raise ScenarioError(f"the reference run in {job_dir} failed (exit {code})")
    ckpt = CheckpointStore(job_dir / "checkpoints").latest()
    if ckpt is None:
        raise ScenarioError(f"the reference run in {job_dir} committed no checkpoint")
    return fingerprint(ckpt).params_sha256


@dataclass(frozen=True)
class GrowConfig:
    """The story's cluster layout and jobs. Defaults: the ``gpu`` partition (node1-2 a100, node3-4 v100) filled but
    for node2's 2 a100 (where the job starts) and, once it trains, node3's 2 v100; an N = 8 job at D2 elastic
    between 2 and 4 GPUs of any type; a 2-GPU gang job (the layout of the daemon's cross-type integration test)."""

    partition: str = "gpu"
    gpu_type: str | None = None  # None: the job may get any type the partition has
    level: DeterminismLevel | None = DeterminismLevel.D2  # D2: the runtime may run the job across GPU types
    #: the fillers' sbatch options besides the partition (plain jobs the daemon does not manage), held throughout
    fillers: tuple[tuple[str, ...], ...] = (
        ("--nodelist=node1", "--gres=gpu:a100:4"),
        ("--nodelist=node2", "--gres=gpu:a100:2"),
        ("--nodelist=node3", "--gres=gpu:v100:2"),
        ("--nodelist=node4", "--gres=gpu:v100:4"),
    )
    #: fillers that hold their GPUs until the elastic job trains, then end: idle GPUs for the daemon to give it
    released: tuple[tuple[str, ...], ...] = (("--nodelist=node3", "--gres=gpu:v100:2"),)
    workers: int = 8
    gpus: int = 2
    min_gpus: int = 2
    max_gpus: int = 4
    steps: int = 80
    step_delay_s: float = 0.25
    ckpt_every: int = 10
    gang_gpus: int = 2
    #: the gang job held its 2 GPUs 25-27 s in two runs here (load 1.3-1.9), long enough for the shrunk job to train
    gang_steps: int = 40
    gang_step_delay_s: float = 0.5
    grace_s: int = 120
    timeout_s: float = 600.0
    #: the example's arguments for a second elastic job (same GPUs, elastic range and N), submitted first and never
    #: waited for: one whose model D2 does not cover stays on its type while the other spans types. () for none.
    bystander_args: tuple[str, ...] = ()

    @classmethod
    def beside_a_d1_job(cls) -> GrowConfig:
        """The story of the daemon's cross-type integration test: the filler on node1 holds 2 of its a100, the
        example's BatchNorm + Dropout model (which the model scanner does not cover, so at D1) starts on the other
        2 and trains throughout; it must never be resized, while v100 are idle and the D2 job spans types."""
        return cls(
            fillers=(
                ("--nodelist=node1", "--gres=gpu:a100:2"),
                ("--nodelist=node2", "--gres=gpu:a100:2"),
                ("--nodelist=node3", "--gres=gpu:v100:2"),
                ("--nodelist=node4", "--gres=gpu:v100:4"),
            ),
            bystander_args=(
                "--model=bn-dropout",
                "--steps=100000",
                "--dataset-size=192",
                "--loader-workers=1",
                "--step-delay=0.5",
            ),
        )

    @property
    def model_args(self) -> tuple[str, ...]:
        """The example's arguments that fix its result (the reference run gets the same)."""
        return ("--model=mlp", f"--steps={self.steps}", "--dataset-size=192", "--loader-workers=1")

    def type_options(self) -> tuple[str, ...]:
        return (f"--partition={self.partition}",) + ((f"--gpu-type={self.gpu_type}",) if self.gpu_type else ())

    def level_options(self) -> tuple[str, ...]:
        return (f"--level={self.level.value}",) if self.level is not None else ()


@dataclass
class GrowResult:
    """What the story saw: its job ids, every poll's samples, the daemon's actions, the two shas, its workdir."""

    workdir: str
    elastic_id: int = 0
    gang_id: int = 0
    filler_ids: list[int] = field(default_factory=list)  # the fillers, held and released
    t0: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    daemon_actions: list[dict[str, Any]] = field(default_factory=list)
    elastic_sha: str = ""
    reference_sha: str = ""
    starts: list[str] = field(default_factory=list)  # the elastic job's "rank 0 of M" lines
    #: where the elastic job ran after the grow and after the shrink: its nodes and GPUs per type
    grown_nodes: tuple[str, ...] = ()
    grown_gpus: tuple[tuple[str, int], ...] = ()
    shrunk_nodes: tuple[str, ...] = ()
    shrunk_gpus: tuple[tuple[str, int], ...] = ()
    gang_nodes: tuple[str, ...] = ()  # where the gang job ran (squeue shows its GPUs untyped: it asked for any)
    bystander_id: int = 0  # the second elastic job (GrowConfig.bystander_args), 0 when none
    bystander_starts: list[str] = field(default_factory=list)
    phases: list[tuple[str, float]] = field(default_factory=list)  # (what, seconds since t0) as each was reached
    loss: list[tuple[int, float]] = field(default_factory=list)  # the elastic job's training loss after each step
    daemon_exit: int | None = None  # the daemon's exit status after the story's SIGTERM

    @property
    def identical(self) -> bool:
        return bool(self.elastic_sha) and self.elastic_sha == self.reference_sha

    def to_dict(self) -> dict[str, Any]:
        return {
            "workdir": self.workdir,
            "elastic_id": self.elastic_id,
            "gang_id": self.gang_id,
            "filler_ids": self.filler_ids,
            "t0": self.t0,
            "samples": [s.to_dict() for s in self.samples],
            "daemon_actions": self.daemon_actions,
            "elastic_sha": self.elastic_sha,
            "reference_sha": self.reference_sha,
            "identical": self.identical,
            "starts": self.starts,
            "grown": {"nodes": list(self.grown_nodes), "gpus": dict(self.grown_gpus)},
            "shrunk": {"nodes": list(self.shrunk_nodes), "gpus": dict(self.shrunk_gpus)},
            "gang_nodes": list(self.gang_nodes),
            "bystander_id": self.bystander_id,
            "bystander_starts": self.bystander_starts,
            "phases": [list(p) for p in self.phases],
            "loss": [list(p) for p in self.loss],
            "daemon_exit": self.daemon_exit,
        }


class _Watch:
    """Polls Slurm for the story's jobs; every poll is kept as samples; waits fail with :class:`ScenarioError`."""

    def __init__(self, slurm: SlurmClient, result: GrowResult, deadline: float, daemon: DaemonProcess) -> None:
        self.slurm, self.result, self.deadline, self.daemon = slurm, result, deadline, daemon
        self.ids: list[int] = []
        self.last: dict[int, Job] = {}

    def poll(self) -> None:
        with contextlib.suppress(SlurmError):
            now = time.time()
            for job in self.slurm.jobs(self.ids) if self.ids else []:
                self.last[job.job_id] = job
                self.result.samples.append(Sample.of(now, job))

    def until(self, what: str, probe: Callable[[], T | None], say: Callable[[str], None]) -> T:
        while True:
            self.poll()
            value = probe()
            if value:
                self.result.phases.append((what, time.time() - self.result.t0))
                say(f"{what} ({time.time() - self.result.t0:.0f} s)")
                return value
            if self.daemon.proc is not None and not self.daemon.alive:
                raise ScenarioError(f"the daemon exited (log {self.daemon.log})")
            for job_id, job in self.last.items():
                ended = not job.state.is_active and job.state is not JobState.COMPLETED
                if ended and job_id not in self.result.filler_ids:
                    raise ScenarioError(f"job {job_id} ended {job.state.value} (workdir {self.result.workdir})")
            if time.monotonic() > self.deadline:
                raise ScenarioError(f"timed out waiting for {what} (workdir {self.result.workdir})")
            time.sleep(1.0)

    def running(self, job_id: int, restarts: int | None = None, gpus: int | None = None) -> Job | None:
        job = self.last.get(job_id)
        if job is None or job.state is not JobState.RUNNING:
            return None
        if (restarts is not None and job.restart_count != restarts) or (gpus is not None and job.gpu_count != gpus):
            return None
        return job

    def completed(self, job_id: int) -> Job | None:
        job = self.last.get(job_id)
        return job if job is not None and job.state is JobState.COMPLETED else None


def _submit(workdir: Path, *options: str, args: Sequence[str]) -> int:
    argv = [
        sys.executable,
        "-m",
        "hpc_elastic",
        "submit",
        str(EXAMPLE),
        f"--ckpt-root={workdir}",
        *options,
        "--",
        *args,
    ]
    out = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60, cwd=REPO)
    if out.returncode != 0:
        raise ScenarioError(f"hpc-elastic submit failed: {out.stderr.strip() or out.stdout.strip()}")
    return int(out.stdout.strip())


def read_loss_log(directory: Path) -> list[LossRecord]:
    """The records of the example's ``--loss-log`` directory (files ``loss-<requeues>-<rank>.jsonl``)."""
    records: list[LossRecord] = []
    for path in sorted(directory.glob("loss-*-*.jsonl")):
        restart, rank = (int(part) for part in path.stem.split("-")[1:3])
        records.extend(parse_loss_line(restart, rank, line) for line in path.read_text().splitlines() if line.strip())
    return records


def _said(path: Path, text: str) -> bool:
    try:
        return text in path.read_text()
    except OSError:
        return False


def _starts(path: Path) -> list[str]:
    """A job's "rank 0 of M (...)" lines, up to their first ';'."""
    try:
        text = path.read_text()
    except OSError:
        return []
    return [line.split(";")[0] for line in text.splitlines() if line.startswith("rank 0 of ")]


@contextlib.contextmanager
def _cleanup(
    slurm: SlurmClient, ids: list[int], daemon: DaemonProcess, state_dir: Path, result: GrowResult
) -> Iterator[None]:
    """The daemon stopped (SIGTERM: it ends its pass; its exit status in ``result``), the story's jobs cancelled and
    the nodes the stopped daemon still held for a resize released (a job that ended right after its resize was
    decided leaves them held until the reservation's end time)."""
    try:
        yield
    finally:
        result.daemon_exit = daemon.kill(signal.SIGTERM)
        cancel_active(slurm, ids)
        release_held_nodes(slurm, state_dir)


def run_grow_story(
    slurm: SlurmClient, root: Path, cfg: GrowConfig = GrowConfig(), *, say: Callable[[str], None] = lambda _: None
) -> GrowResult:
    """Run the story once under ``root/<prefix>``; :class:`ScenarioError` when it could not run to its end."""
    prefix = f"grow{uuid.uuid4().hex[:6]}"
    workdir = root / prefix
    workdir.mkdir(parents=True)
    result = GrowResult(workdir=str(workdir), t0=time.time())
    config = write_resize_config(workdir, prefix, grace_s=cfg.grace_s, policy="tiresias-las+easyscale")
    daemon = DaemonProcess(config, workdir / "daemon.log")
    watch = _Watch(slurm, result, time.monotonic() + cfg.timeout_s, daemon)
    with _cleanup(slurm, watch.ids, daemon, config.parent / "state", result):
        released: list[int] = []
        for index, options in enumerate((*cfg.fillers, *cfg.released)):
            name = f"{prefix}-f{index}"
            job_id = slurm.submit(
                script_text="#!/bin/bash\nsleep 3600\n",
                options=[
                    f"--job-name={name}",
                    f"--output={workdir}/{name}-%j.out",
                    f"--partition={cfg.partition}",
                    *options,
                ],
            )
            result.filler_ids.append(job_id)
            watch.ids.append(job_id)
            if index >= len(cfg.fillers):
                released.append(job_id)
            say(f"filler job {job_id} ({' '.join(options)}), not managed by the daemon")
        watch.until("the fillers run", lambda: all(watch.running(job_id) for job_id in result.filler_ids), say)
        elastic_options = (
            f"--gpus={cfg.gpus}",
            f"--min-gpus={cfg.min_gpus}",
            f"--max-gpus={cfg.max_gpus}",
            f"--workers={cfg.workers}",
            *cfg.type_options(),
        )
        by_out: Path | None = None
        if cfg.bystander_args:
            by_name = f"{prefix}-bn"
            result.bystander_id = bystander = _submit(
                workdir, *elastic_options, f"--job-name={by_name}", args=cfg.bystander_args
            )
            watch.ids.append(bystander)
            by_out = output_path(workdir, by_name, bystander)
            say(f"submitted the elastic job {bystander} ({' '.join(cfg.bystander_args[:1])}): it must stay put")
            watch.until("it runs", lambda: watch.running(bystander), say)
        el_name = f"{prefix}-el"
        result.elastic_id = elastic = _submit(
            workdir,
            *elastic_options,
            *cfg.level_options(),
            f"--job-name={el_name}",
            args=(
                *cfg.model_args,
                f"--ckpt-every={cfg.ckpt_every}",
                f"--step-delay={cfg.step_delay_s}",
                f"--loss-log={workdir / 'loss'}",
            ),
        )
        watch.ids.append(elastic)
        out = output_path(workdir, el_name, elastic)
        say(
            f"submitted the elastic job {elastic}: N={cfg.workers} ESTs on {cfg.gpus} GPUs, "
            f"elastic in [{cfg.min_gpus}, {cfg.max_gpus}]"
            + (f", level {cfg.level.value}" if cfg.level is not None else "")
        )
        watch.until(f"it trains on {cfg.gpus} processes", lambda: _said(out, f"rank 0 of {cfg.gpus} "), say)
        if by_out is not None:
            seen = by_out
            watch.until("the other elastic job trains", lambda: _said(seen, "rank 0 of "), say)
        if released:
            slurm.cancel(released)
            watch.until(
                "the released fillers' GPUs are idle",
                lambda: all(job_id in watch.last and not watch.last[job_id].state.is_active for job_id in released),
                say,
            )
        daemon.start()
        say(f"daemon started: policy tiresias-las+easyscale, scoped to ^{prefix}- (log {daemon.log})")
        grown = watch.until(
            "the daemon grew it (requeued, running again)", lambda: watch.running(elastic, restarts=1), say
        )
        say(f"elastic job now on {grown.gpus} GPUs")
        result.grown_nodes, result.grown_gpus = grown.nodes, grown.gpus.by_type
        watch.until(
            f"it trains on {grown.gpu_count} processes", lambda: _said(out, f"rank 0 of {grown.gpu_count} "), say
        )
        result.gang_id = gang = _submit(
            workdir,
            f"--gpus={cfg.gang_gpus}",
            *cfg.type_options(),
            f"--job-name={prefix}-gang",
            args=(
                "--model=mlp",
                f"--steps={cfg.gang_steps}",
                f"--step-delay={cfg.gang_step_delay_s}",
                "--dataset-size=192",
                "--loader-workers=1",
            ),
        )
        watch.ids.append(gang)
        say(f"submitted a rigid gang job {gang} on {cfg.gang_gpus} GPUs")
        shrunk = watch.until(
            "the daemon shrank the elastic job for it", lambda: watch.running(elastic, restarts=2), say
        )
        say(f"elastic job now on {shrunk.gpus} GPUs ({','.join(shrunk.nodes)})")
        result.shrunk_nodes, result.shrunk_gpus = shrunk.nodes, shrunk.gpus.by_type
        ran = watch.until("the gang job runs", lambda: watch.running(gang) or watch.completed(gang), say)
        result.gang_nodes = ran.nodes
        watch.until("both jobs completed", lambda: watch.completed(elastic) and watch.completed(gang), say)
        if by_out is not None:
            watch.poll()  # the other elastic job as it runs now, before it is cancelled
            result.bystander_starts = _starts(by_out)
        with contextlib.suppress(OSError, ValueError):
            doc = json.loads((workdir / "state" / "state.json").read_text())
            result.daemon_actions = [a for a in doc.get("recent_actions", []) if isinstance(a, dict)]
    text = out.read_text()
    result.starts = _starts(out)
    shas = SHA.findall(text)
    if len(shas) != 1:
        raise ScenarioError(f"the elastic job printed {len(shas)} final parameter shas (see {out})")
    result.elastic_sha = shas[0]
    try:
        result.loss = loss_by_step(read_loss_log(workdir / "loss"), cfg.workers)
    except (OSError, ValueError) as exc:
        raise ScenarioError(f"the elastic job's loss log: {exc}") from None
    say("the uninterrupted reference run: 1 process, same N and level, outside Slurm")
    result.reference_sha = reference_params_sha(
        workdir / "reference", (sys.executable, str(EXAMPLE), *cfg.model_args), workers=cfg.workers, level=cfg.level
    )
    result.phases.append(("the reference run ended", time.time() - result.t0))
    return result
