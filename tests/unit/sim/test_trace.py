"""Trace loaders on the shared traces, and malformed traces rejected with a line number."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_elastic.sim.trace import POLLUX_GPU_HOURS, TraceFormat, TraceFormatError, load_trace
from tests.unit.sim.helpers import TRACES, needs_traces


@needs_traces
def test_tiresias_60_job_trace() -> None:
    trace = load_trace(TRACES / "tiresias_60_job.csv", "tiresias")
    assert len(trace.jobs) == 60 and trace.skipped == 0
    first = trace.jobs[0]
    assert (first.name, first.gpus, first.submit, first.duration, first.model) == ("0", 1, 0.0, 164.0, "vgg19")
    assert first.skew is not None and first.skew > 0.5  # VGG: dominated by its largest tensor (Table 6)
    assert [j.submit for j in trace.jobs] == sorted(j.submit for j in trace.jobs)
    assert {j.gpus for j in trace.jobs} <= {1, 2, 4, 8}


@needs_traces
@pytest.mark.parametrize("number", range(1, 9))
def test_pollux_workloads(number: int) -> None:
    trace = load_trace(TRACES / "pollux_workloads" / f"workload-{number}.csv", TraceFormat.POLLUX)
    assert len(trace.jobs) == 160
    for job in trace.jobs:
        assert job.service == pytest.approx(POLLUX_GPU_HOURS[job.model] * 3600.0)
    assert trace.jobs[0].submit == 0.0


@needs_traces
@pytest.mark.parametrize("name", ["openb_pod_list_default.csv", "openb_pod_list_gpuspec33.csv"])
def test_openb_pods(name: str) -> None:
    trace = load_trace(TRACES / "alibaba_openb" / name, "openb")
    # 8,152 pods; those without GPUs (and zero-length ones) are ignored, not errors
    assert len(trace.jobs) + trace.ignored == 8152
    assert all(job.gpus >= 1 and job.duration > 0 for job in trace.jobs)
    typed = [job for job in trace.jobs if job.gpu_types]
    if name.endswith("gpuspec33.csv"):
        assert typed and any(len(job.gpu_types or ()) > 1 for job in typed)
    else:
        assert not typed


def write(tmp_path: Path, text: str, name: str = "t.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_philly_style_trace(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "job_id,timestamp,duration,num_gpus,gpu_time,cluster\n"
        "a,2017-10-03 10:00:00,600,2,,vc1\n"
        "b,2017-10-03T10:05:00Z,,4,4000,vc2\n",
    )
    trace = load_trace(path, "philly")
    assert [(j.name, j.submit, j.gpus, j.duration) for j in trace.jobs] == [
        ("a", 0.0, 2, 600.0),
        ("b", 300.0, 4, 1000.0),
    ]


@pytest.mark.parametrize(
    ("fmt", "text", "match"),
    [
        (
            "tiresias",
            "job_id,num_gpu,submit_time,duration\n1,2,0,10\n2,x,5,10\n",
            r"t\.csv:3: column 'num_gpu' must be an integer, got 'x'",
        ),
        (
            "tiresias",
            "job_id,num_gpu,submit_time,duration\n1,2,0,-4\n",
            r":2: column 'duration' must be a finite number >= 0.0, got '-4'",
        ),
        (
            "tiresias",
            "job_id,num_gpu,submit_time,duration\n1,1e400,0,10\n",
            r":2: column 'num_gpu' must be an integer, got '1e400'",
        ),
        ("tiresias", "job_id,num_gpu,submit_time\n1,2,0\n", r":1: header lacks column\(s\) duration"),
        ("tiresias", "job_id,num_gpu,submit_time,duration\n1,0,0,5\n", r":2: column 'num_gpu' must be >= 1, got '0'"),
        ("tiresias", "job_id,num_gpu,submit_time,duration\n1,1,0,5,7\n", r":2: more fields than the header"),
        ("pollux", "name,time,application,num_replicas,batch_size\nx,0,gpt9,2,8\n", r":2: unknown application 'gpt9'"),
        (
            "openb",
            "name,num_gpu,gpu_milli,creation_time,deletion_time\np,1,1000,50,10\n",
            r":2: deletion_time 10 is before",
        ),
        (
            "philly",
            "timestamp,duration,num_gpus\nyesterday,5,1\n",
            r":2: column 'timestamp' must be an ISO date-time, got 'yesterday'",
        ),
        ("philly", "timestamp,num_gpus\n2017-10-03 10:00:00,1\n", r":2: needs 'duration'"),
        ("tiresias", "", r"empty file"),
    ],
)
def test_malformed_rows_rejected(tmp_path: Path, fmt: str, text: str, match: str) -> None:
    with pytest.raises(TraceFormatError, match=match):
        load_trace(write(tmp_path, text), fmt)


def test_skip_bad_rows_counts(tmp_path: Path) -> None:
    path = write(tmp_path, "job_id,num_gpu,submit_time,duration\n1,2,0,10\n2,x,5,10\n3,1,7,nan\n4,1,9,3\n")
    trace = load_trace(path, "tiresias", skip_bad_rows=True)
    assert [j.name for j in trace.jobs] == ["1", "4"] and trace.skipped == 2


def test_all_rows_bad_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "job_id,num_gpu,submit_time,duration\n1,x,0,10\n")
    with pytest.raises(TraceFormatError, match="no usable job rows"):
        load_trace(path, "tiresias", skip_bad_rows=True)


def test_openb_cpu_pods_ignored(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "name,num_gpu,gpu_milli,gpu_spec,creation_time,deletion_time\n"
        "cpu,0,0,,0,100\nzero,1,1000,,5,5\ngpu,2,1000,V100M16|V100M32,10,70\n",
    )
    trace = load_trace(path, "openb")
    assert trace.ignored == 2
    (job,) = trace.jobs
    assert (job.gpus, job.duration, job.gpu_types, job.submit) == (2, 60.0, frozenset({"V100M16", "V100M32"}), 0.0)


def test_unknown_format_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown trace format 'csv'"):
        load_trace(tmp_path / "x", "csv")
    with pytest.raises(ValueError, match="cannot read trace"):
        load_trace(tmp_path / "missing.csv", "tiresias")


def test_load_scale_compresses_arrivals(tmp_path: Path) -> None:
    path = write(tmp_path, "job_id,num_gpu,submit_time,duration\n1,1,0,10\n2,1,100,10\n")
    trace = load_trace(path, "tiresias").scaled(4.0)
    assert [j.submit for j in trace.jobs] == [0.0, 25.0]
    with pytest.raises(ValueError, match="load scale"):
        trace.scaled(0.0)


def test_a_header_that_is_not_utf8_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.csv"
    path.write_bytes("job_id,num_gpu,submit_time,dur\xe9e\n".encode("latin-1"))
    with pytest.raises(TraceFormatError, match=r"latin1\.csv:1: not UTF-8 text"):
        load_trace(path, "tiresias")
