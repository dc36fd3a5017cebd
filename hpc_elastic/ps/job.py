"""Run a PS-mode job: the job master, the parameter servers and the workers as real processes
(``python -m hpc_elastic.ps ROLE ...``), with workers added and killed at any time.

Two launchers: ``local`` starts plain processes on this machine, listening on 127.0.0.1; ``srun`` (inside a Slurm
allocation, e.g. on the ``cpu`` partition) starts each process as a job step of its own
(:func:`hpc_elastic.slurm.commands.srun_single`), listening on its node's host name (:data:`NODE_NAME`).

Every server process binds a free port and writes its address to ``<run dir>/<name>.addr`` (atomically; the run
directory must be shared by the nodes under ``srun``); the launcher reads it. The launcher also watches the
processes: a worker that exits other than cleanly (killed, crashed) is reported to the master as lost, so its shards
go back to TODO; a parameter server that exits at all is replaced: a new PS process of the same index starts and the
master rolls the job back onto it from the latest checkpoint (:meth:`hpc_elastic.ps.master.Master.replace_ps`), the
workers going on without a restart. A job master that exits (killed, its node gone) is restarted with ``--restore``
from the latest checkpoint (a job without a checkpoint root fails): it puts every PS back to the checkpoint's
parameters, restores the queues DOING-first and the ledger, and writes its new address to the run directory, where
the workers look it up once the old one stops answering; they drop what they leased or trained since the checkpoint
and go on. A job with a checkpoint root takes a first checkpoint as soon as it is up.
Under ``srun`` a process is killed through Slurm (``scancel --signal=KILL <job>.<step>`` of its step); the launcher
sees the step's ``srun`` exit either way.

Out of memory: each process's step asks for its memory (``--mem``; ``STEP_MEM_MB_PER_CPU`` per core unless told
otherwise), and Slurm kills a step that goes over it (the cgroup's OOM killer, or ``jobacct_gather/linux`` with
``OverMemoryKill``). Given ``step_end`` (how a process's step ended, from Slurm's accounting), the launcher tells a
process that ended out of memory (:attr:`hpc_elastic.slurm.types.Step.out_of_memory`) from one that crashed, and
asks ``memory_after_oom`` (Brain's decision) for the memory it comes back with: a worker is reported lost (its shards
go back to TODO) and a new worker of that memory starts; a PS is replaced, as any lost PS, by one of that memory.
Each such end is kept in ``oom`` (for the job's status).

Placement: given the allocation's nodes (:class:`hpc_elastic.ps.placement.Nodes`), the ``srun`` launcher keeps the
books of the cores its steps hold on each node and starts every step on a node it names (``--nodelist``), the one
:meth:`~hpc_elastic.ps.placement.Nodes.place` picks; a step that fits no node is refused before it starts
(:class:`StepNotPlaced`), and one that Slurm still cannot start within :data:`STEP_PENDING_S` (``--immediate``: the
books and Slurm disagree, say on memory) fails instead of pending; a PS added that way is taken back out, so the job
goes on with the PS it had.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any

from hpc_elastic.errors import HpcElasticError
from hpc_elastic.files import atomic_write_bytes
from hpc_elastic.policy.brain import Role
from hpc_elastic.ps.config import STEP_MEM_MB_PER_CPU, PsJobConfig
from hpc_elastic.ps.placement import Nodes
from hpc_elastic.ps.rpc import Client, PeerUnavailable
from hpc_elastic.slurm import commands
from hpc_elastic.slurm.runner import spawn
from hpc_elastic.slurm.types import Step

#: how long a server process may take to listen
START_TIMEOUT_S = 120.0
POLL_S = 0.05
#: seconds a step may wait for its resources inside the allocation before it fails (``srun --immediate``)
STEP_PENDING_S = 30
#: seconds a worker asked to leave (SIGTERM) has before it is killed (SIGKILL)
LEAVE_GRACE_S = 10.0


def exit_on_signal(signum: int, frame: FrameType | None) -> None:
    """A handler for ``TERM`` and ``INT``: leave by ``SystemExit(128 + signal)``, so that a ``with PsJob(...)``
    block stops its processes on the way out instead of leaving them running."""
    raise SystemExit(128 + signum)


def end_process(popen: subprocess.Popen[bytes], sig: signal.Signals, grace_s: float = LEAVE_GRACE_S) -> int:
    """Send ``sig`` to a process and reap it; one still there after ``grace_s`` is killed (SIGKILL). A worker's
    ``srun`` asked to leave while its step still starts (a scale request that came as Brain's new workers were
    launching, seen on the dev cluster) held a scale-in for 90 s: the shards of a worker killed go back to TODO as
    a lost worker's, so nothing is lost by not waiting longer. The exit status."""
    popen.send_signal(sig)
    try:
        return popen.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        popen.kill()
        return popen.wait()


class ProcessFailed(HpcElasticError):
    """A process of the PS job died before it was ready, or the job did not finish in time."""


class StepNotPlaced(HpcElasticError):
    """A new step fits no node of the allocation, or Slurm did not start it within :data:`STEP_PENDING_S`."""


#: ``--bind`` value of a server process: the address its node's host name resolves to
NODE_NAME = "hostname"


class PsLauncher(StrEnum):
    LOCAL = "local"
    SRUN = "srun"


def write_address(run_dir: Path, name: str, address: str) -> None:
    atomic_write_bytes(run_dir / f"{name}.addr", address.encode())


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: IO[bytes]
    cpus: int = 1
    mem_mb: int = STEP_MEM_MB_PER_CPU
    node: str | None = None  # the node of the allocation its step runs on, where the launcher placed it


@dataclass(frozen=True)
class OutOfMemory:
    """A process whose step Slurm ended for its memory: its step had ``mem_mb`` MiB, its resident set reached
    ``max_rss_mb`` (None when Slurm's accounting does not say)."""

    process: str
    role: Role
    mem_mb: int
    max_rss_mb: float | None


@dataclass(frozen=True)
class OomRecord:
    """An out-of-memory end and what followed: the memory its replacement got and the replacement's name, or why
    there was none (``refused``)."""

    end: OutOfMemory
    new_mem_mb: int | None
    replaced_by: str | None
    refused: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self.end), "new_mem_mb": self.new_mem_mb, "replaced_by": self.replaced_by,
                "refused": self.refused}  # fmt: skip


class PsJob:
    """``with PsJob(config, run_dir) as job: job.wait()`` — master + ``num_ps`` PS + ``num_workers`` workers."""

    def __init__(
        self,
        config: PsJobConfig,
        run_dir: Path,
        *,
        worker_delays: dict[str, float] | None = None,
        checkpoint_dir: Path | None = None,
        checkpoint_every: int = 0,
        restore: bool = False,
        worker_prefix: str = "w",
        launcher: PsLauncher = PsLauncher.LOCAL,
        cpus_per_process: int = 1,
        ps_cpus: int | None = None,
        liveness_s: float | None = None,
        step_end: Callable[[str], Step | None] | None = None,
        memory_after_oom: Callable[[OutOfMemory], int] | None = None,
        nodes: Nodes | None = None,
    ) -> None:
        if restore and checkpoint_dir is None:
            raise ValueError("restore needs a checkpoint_dir")
        if liveness_s is not None and not liveness_s > 0:
            raise ValueError(f"liveness_s must be a positive number of seconds, not {liveness_s!r}")
        self.liveness_s = liveness_s  # the master's (default: its own)
        self.master_restarts = 0
        self.config = config
        self.run_dir = run_dir
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every
        self.restore = restore
        self.worker_prefix = worker_prefix
        self.launcher = PsLauncher(launcher)
        if cpus_per_process < 1:
            raise ValueError(f"cpus_per_process must be >= 1, not {cpus_per_process}")
        self.cpus_per_process = cpus_per_process
        self.ps_cpus = ps_cpus  # cores of each PS the job starts with (default: cpus_per_process)
        self.replaced: list[dict[str, Any]] = []  # the master's reply to each PS replacement
        self.worker_delays = dict(worker_delays or {})
        self.ps: list[_Proc] = []
        self.workers: dict[str, _Proc] = {}
        self.exited: dict[str, int] = {}
        self.master_proc: _Proc | None = None
        self.master: Client | None = None
        self._next_worker = 0
        self._next_ps = 0
        # the local launcher pins each process to cores of its own while there are enough (as srun --exact does)
        self._free_cores = sorted(os.sched_getaffinity(0)) if launcher is PsLauncher.LOCAL else []
        self._pinned: dict[int, list[int]] = {}  # pid -> its cores
        self.step_end = step_end  # how a process's step ended (Slurm's accounting), by the process's name
        self.memory_after_oom = memory_after_oom
        self.oom: list[OomRecord] = []
        self.mem_floor: dict[Role, int] = {}  # after an out-of-memory end: the least memory of a new process of a role
        if nodes is not None and self.launcher is not PsLauncher.SRUN:
            raise ValueError("nodes are the srun launcher's: the local one pins processes to this machine's cores")
        self.nodes = nodes  # the allocation's nodes: each step placed on one of them (srun)
        self._held: dict[int, tuple[str, int]] = {}  # pid -> the node its step runs on and the cores it holds

    # -- processes -----------------------------------------------------------------------------------------------

    def _spawn(
        self, name: str, args: list[str], cpus: int | None = None, mem_mb: int | None = None, *, pin: bool = True
    ) -> _Proc:
        """Start one process of ``cpus`` cores (default: ``cpus_per_process``) and ``mem_mb`` MiB (default:
        ``STEP_MEM_MB_PER_CPU`` per core): a step of exactly that many under ``srun``; here, pinned to that many
        cores of its own while this machine has them free (else, or not to ``pin``, unpinned; the memory is
        Slurm's to enforce)."""
        cpus = self.cpus_per_process if cpus is None else cpus
        mem_mb = STEP_MEM_MB_PER_CPU * cpus if mem_mb is None else mem_mb
        if cpus < 1 or mem_mb < 1:
            raise ValueError(f"a process needs at least one core and 1 MiB, not {cpus} cores and {mem_mb} MiB")
        node = None
        if self.nodes is not None:
            node = self.nodes.place(cpus, self.held_by_node())
            if node is None:
                raise StepNotPlaced(f"{name}: {self.nodes.refusal([cpus], self.held_by_node())}")
        log = (self.run_dir / f"{name}.log").open("ab")
        argv = [sys.executable, "-m", "hpc_elastic.ps", *args]
        if self.launcher is PsLauncher.SRUN:
            pending = STEP_PENDING_S if node is not None else None
            argv = commands.srun_single(argv, name=name, cpus=cpus, mem_mb=mem_mb, node=node, immediate_s=pending)
        popen = spawn(argv, output=log, cwd=os.getcwd(), new_session=False)
        if node is not None:
            self._held[popen.pid] = (node, cpus)
        if self.launcher is PsLauncher.LOCAL and pin and len(self._free_cores) >= cpus:
            cores, self._free_cores = self._free_cores[:cpus], self._free_cores[cpus:]
            self._pinned[popen.pid] = cores
            with contextlib.suppress(ProcessLookupError):  # it died at once: its exit is seen as any other
                os.sched_setaffinity(popen.pid, cores)
        return _Proc(name, popen, log, cpus, mem_mb, node)

    def _release(self, proc: _Proc) -> None:
        """The process ended: its log closed, its cores free again."""
        proc.log.close()
        self._free_cores = sorted(self._free_cores + self._pinned.pop(proc.popen.pid, []))
        self._held.pop(proc.popen.pid, None)

    def held_by_node(self) -> dict[str, int]:
        """The cores the job's steps hold on each node of the allocation (placed steps only)."""
        held: dict[str, int] = {}
        for node, cpus in self._held.values():
            held[node] = held.get(node, 0) + cpus
        return held

    def _address(self, proc: _Proc) -> str:
        path = self.run_dir / f"{proc.name}.addr"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not path.exists():
            if proc.popen.poll() is not None:
                raise ProcessFailed(f"{proc.name} exited with {proc.popen.returncode} before listening (see {path})")
            if time.monotonic() > deadline:
                raise ProcessFailed(f"{proc.name} did not listen within {START_TIMEOUT_S:.0f} s")
            time.sleep(POLL_S)
        return path.read_text()

    def _common(self) -> list[str]:
        bind = NODE_NAME if self.launcher is PsLauncher.SRUN else "127.0.0.1"
        return ["--config", json.dumps(self.config.to_json()), "--run-dir", str(self.run_dir), "--bind", bind]

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.run_dir.glob("*.addr"):  # an earlier run's (a requeued job): never taken for this one's
            stale.unlink()
        restore = ["--restore-from", str(self.checkpoint_dir)] if self.restore else []
        for p in range(self.config.num_ps):
            self.ps.append(self._spawn_ps(p, self.config.num_ps, restore, self.ps_cpus))
        self._start_master(self.restore)
        if self.checkpoint_dir is not None and not self.restore:
            self.checkpoint()  # a PS lost before the first periodic checkpoint is recovered from this one
        for _ in range(self.config.num_workers):
            self.add_worker()

    def _start_master(self, restore: bool) -> None:
        """Start the job master on the current PS (from the latest checkpoint if ``restore``)."""
        addresses = [self._address(p) for p in self.ps]
        config = json.dumps(replace(self.config, num_ps=len(addresses)).to_json())
        bind = NODE_NAME if self.launcher is PsLauncher.SRUN else "127.0.0.1"
        args = ["master", "--config", config, "--ps", ",".join(addresses), "--run-dir", str(self.run_dir)]
        args += ["--bind", bind]
        if self.checkpoint_dir is not None:
            args += ["--checkpoint-dir", str(self.checkpoint_dir), "--checkpoint-every", str(self.checkpoint_every)]
        if restore:
            args.append("--restore")
        if self.liveness_s is not None:
            args += ["--liveness", str(self.liveness_s)]
        # here the job master runs beside the others, unpinned: the cores are the PS's and the workers'
        self.master_proc = self._spawn("master", args, pin=False)
        if self.master is not None:
            self.master.close()
        self.master = Client(self._address(self.master_proc), wait_for_ready=False)

    def _restart_master(self) -> None:
        """The job master exited: a new one from the latest checkpoint, at a new address."""
        assert self.master_proc is not None
        if self.checkpoint_dir is None:
            code = self.master_proc.popen.returncode
            raise ProcessFailed(f"the job master exited with {code} and the job has no checkpoint to restore")
        self._release(self.master_proc)
        (self.run_dir / "master.addr").unlink(missing_ok=True)
        self._start_master(restore=True)
        self.master_restarts += 1

    def kill_master(self) -> None:
        """SIGKILL the job master's process (a failure); :meth:`poll` then restarts it from the checkpoint."""
        assert self.master_proc is not None, "start() first"
        self.master_proc.popen.kill()
        self.master_proc.popen.wait()

    def _memory(self, role: Role, cpus: int | None, mem_mb: int | None) -> int:
        """A new process's memory: ``mem_mb``, else ``STEP_MEM_MB_PER_CPU`` per core, at least its role's floor."""
        if mem_mb is not None:
            return mem_mb
        return max(STEP_MEM_MB_PER_CPU * (self.cpus_per_process if cpus is None else cpus), self.mem_floor.get(role, 0))

    def _spawn_ps(
        self, index: int, num_ps: int, extra: list[str], cpus: int | None = None, mem_mb: int | None = None
    ) -> _Proc:
        """A new PS process (named ``ps<k>``, k counting every PS this job started) as partition ``index``."""
        name = f"ps{self._next_ps}"
        self._next_ps += 1
        args = ["ps", *self._common(), "--index", str(index), "--num-ps", str(num_ps), "--name", name, *extra]
        return self._spawn(name, args, cpus, mem_mb)

    def add_worker(self, delay: float | None = None, cpus: int | None = None, mem_mb: int | None = None) -> str:
        """Start one more worker (scale out) of ``cpus`` cores and ``mem_mb`` MiB; it leases shards as soon as it is
        up. Its id."""
        worker = f"{self.worker_prefix}{self._next_worker}"
        self._next_worker += 1
        assert self.master_proc is not None and self.master is not None, "start() first"
        d = self.worker_delays.get(worker, 0.0) if delay is None else delay
        args = ["worker", "--id", worker, "--master", self.master.address, "--delay", str(d), "--run-dir"]
        args.append(str(self.run_dir))
        self.workers[worker] = self._spawn(worker, args, cpus, self._memory(Role.WORKER, cpus, mem_mb))
        return worker

    def add_ps(self, cpus: int | None = None, mem_mb: int | None = None) -> dict[str, Any]:
        """Start one more PS of ``cpus`` cores and move the parameters onto the new set (the workers wait for the
        move only, not for the new process to start). The master's reply: the number of PS, how long the move took."""
        assert self.master is not None, "start() first"
        p = len(self.ps)
        new = self._spawn_ps(p, p + 1, [], cpus, self._memory(Role.PS, cpus, mem_mb))
        try:
            self._address(new)
        except ProcessFailed as exc:  # its step never started (pending past the bound) or died at once
            if new.popen.poll() is None:
                new.popen.kill()
            new.popen.wait()
            self._release(new)
            raise StepNotPlaced(f"a PS of {new.cpus} cores did not start: {exc}") from None
        self.ps.append(new)
        reply, _ = self.master.call("repartition", {"ps": [self._address(q) for q in self.ps]})
        return reply

    def remove_ps(self, index: int = -1) -> dict[str, Any]:
        """Move the parameters off PS ``index`` (the last by default) onto the others, then stop it. The master's
        reply."""
        assert self.master is not None, "start() first"
        if len(self.ps) < 2:
            raise ValueError(f"cannot remove a PS from {len(self.ps)}: a job needs at least one")
        gone = self.ps[index]
        rest = [q for q in self.ps if q is not gone]
        reply, _ = self.master.call("repartition", {"ps": [self._address(q) for q in rest]})
        self.ps = rest
        Client(self._address(gone), timeout=15).call("stop")
        gone.popen.wait(timeout=60)
        self._release(gone)
        (self.run_dir / f"{gone.name}.addr").unlink()
        return reply

    def replace_ps(self, index: int, cpus: int) -> dict[str, Any]:
        """Replace PS ``index`` by one of ``cpus`` cores (a hot PS by a larger one): the new PS joins, then the old
        one leaves, each a re-partition while the workers wait. The master's reply to the second."""
        self.add_ps(cpus)
        return self.remove_ps(index)

    @property
    def ps_cores(self) -> tuple[int, ...]:
        """The cores of each PS, in partition order."""
        return tuple(p.cpus for p in self.ps)

    @property
    def worker_cores(self) -> dict[str, int]:
        return {w: p.cpus for w, p in self.workers.items()}

    @property
    def ps_mem_mb(self) -> tuple[int, ...]:
        """The memory of each PS's step, in partition order."""
        return tuple(p.mem_mb for p in self.ps)

    @property
    def worker_mem_mb(self) -> dict[str, int]:
        return {w: p.mem_mb for w, p in self.workers.items()}

    def kill_ps(self, index: int) -> None:
        """SIGKILL PS ``index``'s process (a failure); :meth:`poll` then replaces it."""
        proc = self.ps[index]
        proc.popen.kill()
        proc.popen.wait()

    def _replace_ps(self, index: int, mem_mb: int | None = None) -> dict[str, Any]:
        """PS ``index`` exited: start a new one of that index (of ``mem_mb`` MiB, default its own) and have the
        master roll the job back onto it."""
        old = self.ps[index]
        self._release(old)
        (self.run_dir / f"{old.name}.addr").unlink(missing_ok=True)
        args = ["ps", *self._common(), "--index", str(index), "--num-ps", str(len(self.ps)), "--name", old.name]
        self.ps[index] = self._spawn(old.name, args, old.cpus, old.mem_mb if mem_mb is None else mem_mb)
        assert self.master is not None
        reply, _ = self.master.call("replace_ps", {"index": index, "address": self._address(self.ps[index])})
        self.replaced.append(reply)
        return reply

    def signal_worker(self, worker: str, sig: signal.Signals) -> None:
        """Send ``sig`` to a worker's process (SIGSTOP/SIGCONT freeze and thaw it where it is)."""
        self.workers[worker].popen.send_signal(sig)

    def kill_worker(self, worker: str, sig: signal.Signals = signal.SIGKILL) -> dict[str, Any]:
        """Kill a worker's process (SIGKILL: a failure; SIGTERM: scale in) and report it lost to the master."""
        end_process(self.workers[worker].popen, sig)
        return self._lost(worker)

    def _lost(self, worker: str) -> dict[str, Any]:
        proc = self.workers.pop(worker)
        self.exited[worker] = proc.popen.returncode
        self._release(proc)
        assert self.master is not None
        reply, _ = self.master.call("worker_lost", {"worker": worker})
        return reply

    def checkpoint(self) -> int:
        """Checkpoint the job now (queues, ledger and every PS's parameters); the checkpoint's sequence number."""
        assert self.master is not None
        reply, _ = self.master.call("checkpoint")
        return int(reply["seq"])

    def kill_all(self) -> None:
        """SIGKILL every process of the job at once (a failure of the master and the PS, say a node lost)."""
        procs = [*self.workers.values(), *self.ps, *([self.master_proc] if self.master_proc else [])]
        for proc in procs:
            proc.popen.kill()
        for proc in procs:
            proc.popen.wait()

    def poll(self) -> None:
        """Restart a job master that exited; replace the PS that exited; reap the workers that exited: a clean exit
        is the end of training for them; any other is a loss."""
        if self.master_proc is not None and self.master_proc.popen.poll() is not None:
            self._restart_master()
        for index, ps in enumerate(self.ps):
            if ps.popen.poll() is not None:
                end = self._out_of_memory(ps, Role.PS)
                mem, refused = self._memory_after(end) if end is not None else (None, None)
                self._replace_ps(index, mem)  # a refused PS comes back as it was: the parameters need it
                if end is not None:
                    self._record(OomRecord(end, mem, ps.name, refused))
        for worker, proc in list(self.workers.items()):
            code = proc.popen.poll()
            if code is None:
                continue
            if code == 0:
                self.workers.pop(worker)
                self.exited[worker] = 0
                self._release(proc)
                continue
            end = self._out_of_memory(proc, Role.WORKER)
            self._lost(worker)
            if end is not None:
                mem, refused = self._memory_after(end)
                new = self.add_worker(cpus=proc.cpus, mem_mb=mem) if mem is not None else None
                self._record(OomRecord(end, mem, new, refused))

    def _out_of_memory(self, proc: _Proc, role: Role) -> OutOfMemory | None:
        """How ``proc``'s step ended, if Slurm ended it for its memory; None otherwise or without ``step_end``."""
        step = self.step_end(proc.name) if self.step_end is not None else None
        if step is None or not step.out_of_memory:
            return None
        return OutOfMemory(proc.name, role, proc.mem_mb, step.max_rss_mb)

    def _memory_after(self, end: OutOfMemory) -> tuple[int | None, str | None]:
        """The memory the process comes back with (``memory_after_oom``), or None and why not."""
        if self.memory_after_oom is None:
            return None, "no memory decision given"
        try:
            return self.memory_after_oom(end), None
        except ValueError as exc:
            return None, str(exc)

    def _record(self, record: OomRecord) -> None:
        self.oom.append(record)
        if record.new_mem_mb is not None:
            role = record.end.role
            self.mem_floor[role] = max(self.mem_floor.get(role, 0), record.new_mem_mb)
        end = record.end
        then = f"{record.replaced_by} with {record.new_mem_mb} MiB" if record.new_mem_mb else f"({record.refused})"
        print(
            f"hpc-elastic ps: {end.process} ({end.role.value}) out of memory at {end.mem_mb} MiB: {then}",
            file=sys.stderr,
            flush=True,
        )

    def status(self) -> dict[str, Any]:
        assert self.master is not None
        reply, _ = self.master.call("status")
        return reply

    def held_out(self) -> dict[str, Any]:
        """The model's mean log loss on records no worker trains on, now and initially
        (:meth:`hpc_elastic.ps.master.Master.held_out`)."""
        assert self.master is not None
        reply, _ = self.master.call("held_out")
        return reply

    def wait(self, timeout: float = 300.0) -> dict[str, Any]:
        """Until training is finished and every worker has exited; the master's final status, with the trained
        model's held-out loss (``held_out``)."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            try:
                status = self.status()
            except PeerUnavailable:  # the master died since poll(): the next one restarts it
                time.sleep(POLL_S)
                continue
            if status["finished"] and not self.workers:
                return {**status, "held_out": self.held_out()}
            if not self.workers and not status["finished"]:
                raise ProcessFailed(f"no worker left and training not finished: {status['queues']}")
            if time.monotonic() > deadline:
                raise ProcessFailed(f"training not finished within {timeout:.0f} s: {status['queues']}")
            time.sleep(POLL_S * 4)

    def close(self) -> None:
        for proc in self.workers.values():
            proc.popen.kill()
        servers = ([self.master_proc] if self.master_proc else []) + self.ps
        for proc in servers:
            if proc.popen.poll() is None:
                try:
                    Client(self._address(proc), timeout=5).call("stop")
                except HpcElasticError:
                    proc.popen.terminate()
        for proc in [*self.workers.values(), *servers]:
            try:
                proc.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
            self._release(proc)
        self.workers.clear()
        if self.master is not None:
            self.master.close()

    def __enter__(self) -> PsJob:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
