"""The Slurm client: a Protocol with a CLI backend (default) and a pyslurm backend (only on a version match).

One query serves many jobs: :meth:`SlurmClient.jobs` runs one ``squeue`` whatever the number of ids, and filters
client-side (Slurm 22.05's ``squeue --json`` ignores ``--jobs``).
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

from hpc_elastic.env import Environment
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.slurm import commands, parse
from hpc_elastic.slurm.commands import JobAction
from hpc_elastic.slurm.errors import JobNotFound, SlurmCommandError
from hpc_elastic.slurm.runner import RetryPolicy, Runner
from hpc_elastic.slurm.types import Job, JobRef, Node, Partition, Step

log = logging.getLogger(__name__)

_NO_JSON = re.compile(r"unrecognized option '--json'|invalid option.*json|serializer|data_parser", re.IGNORECASE)


@runtime_checkable
class SlurmClient(Protocol):
    """What hpc-elastic needs from Slurm. Implementations raise the errors of :mod:`hpc_elastic.slurm.errors`."""

    def version(self) -> str: ...
    def ping(self) -> None: ...
    def jobs(self, job_ids: Iterable[int] | None = None, *, site_factors: bool = False) -> list[Job]: ...
    def job(self, job_id: int) -> Job: ...
    def nodes(self) -> list[Node]: ...
    def partitions(self) -> list[Partition]: ...
    def history(
        self,
        start: datetime,
        end: datetime | None = None,
        job_ids: Iterable[int] | None = None,
        *,
        user_text: bool = True,
    ) -> list[Job]: ...
    def submit(
        self, script_path: str | None = None, options: Sequence[str] = (), *, script_text: str | None = None
    ) -> int: ...
    def accounts(self) -> frozenset[str]: ...
    def update_job(self, job_id: int | JobRef, fields: Mapping[str, str | int]) -> None: ...
    def act(self, action: JobAction, job_ids: Iterable[int | JobRef]) -> None: ...
    def requeue(self, job_ids: Iterable[int | JobRef]) -> None: ...
    def create_reservation(self, name: str, nodes: Sequence[str], user: str, duration_s: float) -> None: ...
    def end_reservation(self, name: str) -> None: ...
    def cancel(
        self, job_ids: Iterable[int | JobRef], signal: str | None = None, *, batch: bool = False, full: bool = False
    ) -> None: ...


class CliSlurm:
    """Slurm through its command-line tools (``--json`` where available, fixed-field text otherwise)."""

    name = "cli"

    def __init__(
        self, runner: Runner | None = None, *, use_json: bool | None = None, history_json: bool = False
    ) -> None:
        self.runner = runner or Runner()
        self._json = use_json  # None: find out on first use
        # sacct --json of Slurm 22.05 (dbv0.0.38) reports exit_code SUCCESS/0 for jobs that failed with a
        # non-zero code (seen on the dev cluster), so history is read from --parsable2 unless asked otherwise.
        self._history_json = history_json

    # ----------------------------------------------------------------------------------------- reads

    def version(self) -> str:
        out = self.runner.run(commands.scontrol_version()).stdout
        match = re.search(r"(\d+\.\d+\.\d+)", out)
        if not match:
            raise SlurmCommandError(commands.scontrol_version(), 0, out, f"cannot read a version from {out!r}")
        return match.group(1)

    def ping(self) -> None:
        self.runner.run(commands.scontrol_ping())

    def _read_json_or_text(self, json_argv: list[str], text_argv: list[str]) -> tuple[bool, str]:
        if self._json is not False:
            try:
                out = self.runner.run(json_argv).stdout
                self._json = True
                return True, out
            except SlurmCommandError as exc:
                if self._json is None and _NO_JSON.search(exc.stderr):
                    log.debug("%s has no --json here (%s); using text output", json_argv[0], exc.stderr)
                    self._json = False
                else:
                    raise
        return False, self.runner.run(text_argv).stdout

    def jobs(self, job_ids: Iterable[int] | None = None, *, site_factors: bool = False) -> list[Job]:
        wanted = None if job_ids is None else set(commands.job_id_list(job_ids))
        if wanted is not None and not wanted:
            return []
        ids = sorted(wanted) if wanted is not None else None
        is_json, out = self._read_json_or_text(commands.squeue_json(ids), commands.squeue_text(ids))
        found = parse.parse_squeue_json(out) if is_json else parse.parse_squeue_text(out)
        if wanted is not None:
            found = [job for job in found if job.job_id in wanted]
        if site_factors:
            pending = [job.job_id for job in found if job.state.is_pending]
            factors = self.site_factors(pending) if pending else {}
            found = [_with_site_factor(job, factors.get(job.job_id)) for job in found]
        return found

    def site_factors(self, job_ids: Iterable[int]) -> dict[int, int]:
        """Site factors of pending jobs (``sprio`` reports pending jobs only)."""
        ids = commands.job_id_list(job_ids)
        if not ids:
            return {}
        try:
            out = self.runner.run(commands.sprio_site_factors(ids)).stdout
        except JobNotFound:
            return {}
        except SlurmCommandError as exc:
            if "unable to find jobs" in exc.stderr.lower():
                return {}
            raise
        return parse.parse_sprio_site_factors(out)

    def job(self, job_id: int) -> Job:
        found = self.jobs([job_id])
        if not found:
            argv = commands.squeue_json([job_id])
            raise JobNotFound(argv, 0, f"Invalid job id specified: {job_id}")
        return found[0]

    def nodes(self) -> list[Node]:
        is_json, out = self._read_json_or_text(commands.sinfo_json(), commands.scontrol_show_nodes())
        return parse.parse_sinfo_json(out) if is_json else parse.parse_scontrol_nodes(out)

    def partitions(self) -> list[Partition]:
        return parse.parse_scontrol_partitions(self.runner.run(commands.scontrol_show_partitions()).stdout)

    def accounts(self) -> frozenset[str]:
        """The accounts of Slurm's accounting (slurmdbd), lower case."""
        return parse.parse_sacctmgr_accounts(self.runner.run(commands.sacctmgr_accounts()).stdout)

    def history(
        self,
        start: datetime,
        end: datetime | None = None,
        job_ids: Iterable[int] | None = None,
        *,
        user_text: bool = True,
    ) -> list[Job]:
        """Finished and active jobs from accounting (``sacct``) in a window; each requeue is its own record.
        Without ``user_text`` the text output leaves out what users write (names, comments: empty in the records),
        which could otherwise forge fields or records (the daemon reads history so)."""
        ids = None if job_ids is None else commands.job_id_list(job_ids)
        if ids is not None and not ids:
            return []
        text_argv = commands.sacct_text(start, end, ids, user_text=user_text)
        if not self._history_json:
            return parse.parse_sacct_text(self.runner.run(text_argv).stdout, user_text=user_text)
        is_json, out = self._read_json_or_text(commands.sacct_json(start, end, ids), text_argv)
        return parse.parse_sacct_json(out) if is_json else parse.parse_sacct_text(out, user_text=user_text)

    def steps(self, job_id: int) -> list[Step]:
        """The steps of a job from accounting (``sacct``): ended ones with how they ended, running ones."""
        return parse.parse_sacct_steps(self.runner.run(commands.sacct_steps(job_id)).stdout)

    def step_history(self, start: datetime, end: datetime | None = None) -> list[Step]:
        """Every step, with its start, end and cores, of the jobs in a window from accounting (one ``sacct``)."""
        return parse.parse_sacct_step_times(self.runner.run(commands.sacct_step_times(start, end)).stdout)

    # ---------------------------------------------------------------------------------------- writes

    def submit(
        self, script_path: str | None = None, options: Sequence[str] = (), *, script_text: str | None = None
    ) -> int:
        """``sbatch --parsable``: a script file, or the script's text on standard input. Returns the job id."""
        if (script_path is None) == (script_text is None):
            raise ValueError("submit needs exactly one of script_path and script_text")
        if script_text is not None and not script_text.startswith("#!"):
            first = script_text.split("\n", 1)[0][:60]
            raise ValueError(f"a batch script must start with '#!' (e.g. #!/bin/bash), got {first!r}")
        argv = commands.sbatch(script_path, options)
        out = self.runner.run(argv, stdin=script_text, idempotent=False).stdout
        return parse.parse_sbatch_parsable(out)

    def update_job(self, job_id: int | JobRef, fields: Mapping[str, str | int]) -> None:
        self.runner.run(commands.scontrol_update(job_id, fields), idempotent=True)

    def set_priority(self, job_id: int, priority: int) -> None:
        self.update_job(job_id, {"Priority": priority})

    def set_site_factor(self, job_id: int, factor: int) -> None:
        self.update_job(job_id, {"SiteFactor": factor})

    def set_num_nodes(self, job_id: int, num_nodes: int | str) -> None:
        self.update_job(job_id, {"NumNodes": num_nodes})

    def set_time_limit(self, job_id: int, limit: str) -> None:
        self.update_job(job_id, {"TimeLimit": limit})

    def act(self, action: JobAction, job_ids: Iterable[int | JobRef]) -> None:
        # requeue/hold/release/suspend/resume are safe to repeat: Slurm refuses a second one with an error
        self.runner.run(commands.scontrol_action(action, job_ids), idempotent=True)

    def requeue(self, job_ids: Iterable[int | JobRef]) -> None:
        self.act(JobAction.REQUEUE, job_ids)

    def create_reservation(self, name: str, nodes: Sequence[str], user: str, duration_s: float) -> None:
        """Hold whole ``nodes`` for ``user``'s jobs that ask for reservation ``name``, from now for ``duration_s``
        (:func:`commands.scontrol_create_reservation`)."""
        self.runner.run(commands.scontrol_create_reservation(name, nodes, user, duration_s), idempotent=False)

    def end_reservation(self, name: str) -> None:
        """End reservation ``name`` now; a job running in it keeps running (it was created ``FLEX``)."""
        self.runner.run(commands.scontrol_end_reservation(name), idempotent=True)

    def hold(self, job_ids: Iterable[int]) -> None:
        self.act(JobAction.HOLD, job_ids)

    def release(self, job_ids: Iterable[int]) -> None:
        self.act(JobAction.RELEASE, job_ids)

    def suspend(self, job_ids: Iterable[int]) -> None:
        self.act(JobAction.SUSPEND, job_ids)

    def resume(self, job_ids: Iterable[int]) -> None:
        self.act(JobAction.RESUME, job_ids)

    def cancel(
        self, job_ids: Iterable[int | JobRef], signal: str | None = None, *, batch: bool = False, full: bool = False
    ) -> None:
        """Cancel or signal jobs (an array task by its :class:`JobRef`). Unknown ids raise :class:`JobNotFound`
        before anything is sent: scancel itself exits 0 and says nothing for a job id Slurm does not know (22.05)."""
        wanted = list(job_ids)
        argv = commands.scancel(wanted, signal, batch=batch, full=full)
        ids = commands.job_id_list(w.job_id if isinstance(w, JobRef) else w for w in wanted)
        known = {name for job in self.jobs(ids) for name in (str(job.job_id), str(job.ref))}
        missing = [ref for ref in commands.job_refs(wanted) if ref not in known]
        if missing:
            raise JobNotFound(argv, 0, f"Invalid job id specified: {','.join(map(str, missing))}")
        self.runner.run(argv, idempotent=signal is None)


def _with_site_factor(job: Job, factor: int | None) -> Job:
    if factor is None:
        return job
    fields = dict(job.__dict__)
    fields["site_factor"] = factor
    return Job(**fields)


class PyslurmSlurm(CliSlurm):
    """Reads jobs through pyslurm's C bindings (no process per query), everything else through the CLI.

    Chosen by :func:`connect` only when pyslurm imports and its major.minor equals the running Slurm's.
    PyPI's pyslurm 25.11 refuses Slurm 22.05, so the dev cluster never selects it; the attribute mapping in
    :func:`job_from_pyslurm` follows pyslurm 25.11's documented ``pyslurm.Job`` attributes.
    """

    name = "pyslurm"

    def __init__(self, module: ModuleType, runner: Runner | None = None) -> None:
        super().__init__(runner, use_json=True)
        self._pyslurm = module

    def jobs(self, job_ids: Iterable[int] | None = None, *, site_factors: bool = False) -> list[Job]:
        wanted = None if job_ids is None else set(commands.job_id_list(job_ids))
        found = [job_from_pyslurm(obj) for obj in self._pyslurm.Jobs.load().values()]
        if wanted is not None:
            found = [job for job in found if job.job_id in wanted]
        if site_factors:
            factors = self.site_factors([job.job_id for job in found if job.state.is_pending])
            found = [_with_site_factor(job, factors.get(job.job_id)) for job in found]
        return found


def job_from_pyslurm(obj: object) -> Job:
    """A :class:`Job` from a ``pyslurm.Job`` (attributes as in pyslurm 25.11)."""

    def attr(name: str) -> Any:
        return getattr(obj, name, None)

    state = parse.job_state(attr("state"))
    limit = parse.number(attr("time_limit"))
    tres = parse.parse_tres(str(attr("tres_alloc_str") or attr("tres_req_str") or ""))
    return Job(
        job_id=int(attr("id")),
        name=str(attr("name") or ""),
        user=str(attr("user_name") or ""),
        state=state,
        partition=str(attr("partition") or ""),
        account=str(attr("account") or ""),
        array_job_id=parse.number(attr("array_id")) or None,
        array_task_id=parse.number(attr("array_task_id")),
        het_job_id=parse.number(attr("het_job_id")) or None,
        het_job_offset=parse.number(attr("het_job_offset")),
        submit_time=parse.epoch(attr("submit_time")),
        eligible_time=parse.epoch(attr("eligible_time")),
        start_time=parse.epoch(attr("start_time")) if state.is_running or not state.is_active else None,
        end_time=parse.epoch(attr("end_time")) if not state.is_active else None,
        time_limit_s=limit * 60 if limit is not None else None,
        nodes=parse.expand_hostlist(str(attr("nodes") or "")),
        node_count=parse.number(attr("num_nodes")) or 0,
        gpus=parse.gpus_from_tres(tres),
        cpus=parse.number(attr("cpus")) or 0,
        memory_mb=parse.number(attr("memory")),
        priority=parse.number(attr("priority")),
        comment=str(attr("comment") or ""),
        restart_count=parse.number(attr("requeue_count")) or 0,
        pending_reason=str(attr("state_reason") or "") if state.is_pending else "",
        preempt_time=parse.epoch(attr("preempt_time")) if state.is_running or not state.is_active else None,
    )


def _major_minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def pyslurm_match(slurm_version: str) -> tuple[ModuleType | None, str]:
    """(pyslurm module, reason): the module only when its major.minor equals ``slurm_version``'s."""
    try:
        module = importlib.import_module("pyslurm")
    except ImportError as exc:
        return None, f"pyslurm does not import ({exc})"
    own = str(getattr(module, "__version__", ""))
    if _major_minor(own) is None or _major_minor(own) != _major_minor(slurm_version):
        return None, f"pyslurm {own or '?'} does not match Slurm {slurm_version}"
    return module, f"pyslurm {own} matches Slurm {slurm_version}"


def connect(environment: Environment | None = None, runner: Runner | None = None) -> CliSlurm:
    """The client for this site: pyslurm when asked or ``auto`` and its version matches, else the CLI."""
    env = environment or Environment()
    run = runner or Runner(timeout_s=env.slurm_timeout_s, retry=RetryPolicy())
    cli = CliSlurm(run)
    if env.slurm_backend == "cli":
        return cli
    module, reason = pyslurm_match(cli.version())
    if module is None:
        if env.slurm_backend == "pyslurm":
            raise HpcElasticError(f"HPC_ELASTIC_SLURM_BACKEND=pyslurm but {reason}")
        log.debug("using the CLI Slurm backend: %s", reason)
        return cli
    log.debug("using the pyslurm backend: %s", reason)
    return PyslurmSlurm(module, run)
