"""Exact argv of every Slurm command, and rejection of bad values before anything runs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from hpc_elastic.jobdir import ScaleNotice, StopNotice, StopReason
from hpc_elastic.slurm import commands
from hpc_elastic.slurm.commands import JobAction
from hpc_elastic.slurm.types import JobRef


def test_reads() -> None:
    assert commands.squeue_json() == ["squeue", "--all", "--json"]
    assert commands.squeue_json([3, 1, 3]) == ["squeue", "--all", "--json", "--jobs=3,1"]
    text = commands.squeue_text([5])
    assert text[:4] == ["squeue", "--all", "--noheader", "--states=all"]
    assert text[4].startswith("--format=%A\x1f%F\x1f%K") and text[-1] == "--jobs=5"
    assert commands.sinfo_json() == ["sinfo", "--json"]
    assert commands.scontrol_show_nodes() == ["scontrol", "show", "node", "--oneliner"]
    assert commands.scontrol_show_partitions() == ["scontrol", "show", "partition", "--oneliner"]
    assert commands.sprio_site_factors([9]) == ["sprio", "--noheader", "--format=%i|%S", "--jobs=9"]


def test_sacct_window_in_utc() -> None:
    start = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=2)))
    assert commands.sacct_json(start, job_ids=[7]) == [
        "sacct",
        "--json",
        "--allusers",
        "--duplicates",
        "--starttime=2026-01-02T01:04:05",
        "--jobs=7",
    ]
    end = datetime(2026, 1, 3, tzinfo=UTC)
    argv = commands.sacct_text(start, end)
    assert argv[:4] == ["sacct", "--parsable2", "--noheader", "--allocations"]
    assert argv[-1] == "--endtime=2026-01-03T00:00:00"
    with pytest.raises(ValueError, match="timezone-aware"):
        commands.sacct_json(datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="before it starts"):
        commands.sacct_json(end, start)


def test_sbatch() -> None:
    assert commands.sbatch("/gpfs/job.sh", ["--gres=gpu:a100:2", "-N", "1"][:1]) == [
        "sbatch",
        "--parsable",
        "--gres=gpu:a100:2",
        "/gpfs/job.sh",
    ]
    assert commands.sbatch(None) == ["sbatch", "--parsable"]
    with pytest.raises(ValueError, match="option must start"):
        commands.sbatch("x.sh", ["gres=gpu:1"])
    with pytest.raises(ValueError, match="one line"):
        commands.sbatch("x.sh", ["--comment=a\n#SBATCH --x"])
    with pytest.raises(ValueError, match="bad batch script"):
        commands.sbatch("--wrap=x")


def test_scontrol_update() -> None:
    assert commands.scontrol_update(12, {"Priority": 100, "SiteFactor": -5}) == [
        "scontrol",
        "update",
        "JobId=12",
        "Priority=100",
        "SiteFactor=-5",
    ]
    assert commands.scontrol_update(3, {"NumNodes": 1, "ReqNodeList": "node[1-2]", "TimeLimit": "1-00:00:00"})[3:] == [
        "NumNodes=1",
        "ReqNodeList=node[1-2]",
        "TimeLimit=1-00:00:00",
    ]
    with pytest.raises(ValueError, match="cannot update job field 'Partition'"):
        commands.scontrol_update(1, {"Partition": "x"})
    with pytest.raises(ValueError, match="bad value for Priority: -1"):
        commands.scontrol_update(1, {"Priority": -1})
    with pytest.raises(ValueError, match="bad value for ReqNodeList"):
        commands.scontrol_update(1, {"ReqNodeList": "node1 Priority=9"})
    with pytest.raises(ValueError, match="at least one field"):
        commands.scontrol_update(1, {})
    with pytest.raises(ValueError, match="positive integer, got 0"):
        commands.scontrol_update(0, {"Priority": 1})


def test_the_daemons_notices_are_the_only_admin_comments_it_sets() -> None:
    stop = StopNotice(StopReason.PREEMPT, 1_700_000_000.25, 3).encode()
    scale = ScaleNotice(4, 2, 1_700_000_000.25, 3).encode()
    for notice in (stop, scale, ""):
        assert commands.scontrol_update(5, {"AdminComment": notice})[3] == f"AdminComment={notice}"
    for bad in ("hpc-elastic-scale:workers=4 Priority=9", "anything", "hpc-elastic-grow:workers=4"):
        with pytest.raises(ValueError, match="bad value for AdminComment"):
            commands.scontrol_update(5, {"AdminComment": bad})


def test_actions_and_scancel() -> None:
    assert commands.scontrol_action(JobAction.REQUEUE, [4, 5]) == ["scontrol", "requeue", "4,5"]
    assert commands.scontrol_action(JobAction("hold"), [4]) == ["scontrol", "hold", "4"]
    with pytest.raises(ValueError, match="no job id"):
        commands.scontrol_action(JobAction.RELEASE, [])
    assert commands.scancel([8]) == ["scancel", "8"]
    assert commands.scancel([8, 9], "SIGUSR1", batch=True) == ["scancel", "--signal=USR1", "--batch", "8", "9"]
    assert commands.scancel([8], "term", full=True) == ["scancel", "--signal=TERM", "--full", "8"]
    with pytest.raises(ValueError, match="unknown signal 'FOO'"):
        commands.scancel([8], "FOO")
    with pytest.raises(ValueError, match="exclude each other"):
        commands.scancel([8], batch=True, full=True)
    with pytest.raises(ValueError, match="no job id"):
        commands.scancel([], "USR1")
    with pytest.raises(ValueError, match="positive integer, got True"):
        commands.scancel([True])


def test_scontrol_update_size_of_a_pending_job() -> None:
    assert commands.scontrol_update(7, {"NumTasks": 2, "NumCPUs": 2, "NumNodes": "1-2"}) == [
        "scontrol",
        "update",
        "JobId=7",
        "NumTasks=2",
        "NumCPUs=2",
        "NumNodes=1-2",
    ]
    for bad in (0, -1, "2 Priority=9", "x"):
        with pytest.raises(ValueError, match="bad value for NumTasks"):
            commands.scontrol_update(7, {"NumTasks": bad})
    with pytest.raises(ValueError, match="bad value for NumCPUs"):
        commands.scontrol_update(7, {"NumCPUs": 0})


def test_array_tasks_are_addressed_as_array_underscore_task() -> None:
    """The array's job id alone names every task of the array (a requeue of it requeues them all)."""
    assert commands.scontrol_action(JobAction.REQUEUE, [JobRef(510, 3), 7, JobRef(7)]) == [
        "scontrol",
        "requeue",
        "510_3,7",
    ]
    assert commands.scontrol_update(JobRef(510, 1), {"Features": "a100"}) == [
        "scontrol",
        "update",
        "JobId=510_1",
        "Features=a100",
    ]
    assert commands.sacctmgr_accounts() == [
        "sacctmgr",
        "--parsable2",
        "--noheader",
        "show",
        "account",
        "format=Account",
    ]
    with pytest.raises(ValueError, match="array task id must be a non-negative integer"):
        JobRef(510, -1)


def test_sacct_steps_of_one_job() -> None:
    assert commands.sacct_steps(42) == [
        "sacct",
        "--parsable2",
        "--noheader",
        "--format=JobID,JobName,State,ExitCode,MaxRSS,AllocTRES",
        "--jobs=42",
    ]
    with pytest.raises(ValueError, match="positive integer, got 0"):
        commands.sacct_steps(0)
