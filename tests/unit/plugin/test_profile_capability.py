"""C_i from a job's profile in the daemon (EasyScale §3.4): the throughput ``hpc-elastic profile`` measured for the
job's model on each GPU type, relative to each other, is the estimate the job's observations then correct; a type
without a profile, a job without one, or a profile file that does not parse gets the default (1)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from hpc_elastic.jobdir import JobDir
from hpc_elastic.policy.hetero import EstProfile
from hpc_elastic.profile import load_profile
from hpc_elastic.profile.store import SOURCE_PROFILE_DIR
from hpc_elastic.slurm import GpuCounts, Job, Node
from slurm_plugin.actions import Resize
from slurm_plugin.cli import profile_capability
from slurm_plugin.daemon import Daemon
from slurm_plugin.easyscale import estimated_capability, prior_capability, profiled_rates
from slurm_plugin.store import Store
from tests.unit.plugin.conftest import config
from tests.unit.plugin.test_daemon import Clock, FakeSlurm
from tests.unit.plugin.test_spanning import _captured, _elastic_on_node1
from tests.unit.plugin.test_telemetry import record

ME = os.getuid()
D2 = "hpc-elastic:v=1,workers=8,min=2,max=8,unit=gpu,backend=torch,level=d2,profile=mlp@a100"
SOURCE = SOURCE_PROFILE_DIR / "mlp@cpu-amd-epyc.json"


def write_profile(directory: Path, gpu_type: str, slower: float, **changes: Any) -> Path:
    """The shipped MLP profile as if measured on ``gpu_type``, every step ``slower`` times the CPU's."""
    doc = json.loads(SOURCE.read_text())
    doc["name"] = f"mlp@{gpu_type}"
    doc["device"]["type"] = gpu_type
    for point in doc["points"]:
        for key in ("step_time_s", "step_time_min_s", "step_time_max_s"):
            point[key] *= slower
        point["batches_per_s"] = 1.0 / point["step_time_s"]
        point["samples_per_s"] = point["batch_size"] / point["step_time_s"]
    doc.update(changes)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"mlp@{gpu_type}.json"
    path.write_text(json.dumps(doc))
    return path


def test_profiled_rates_compare_the_types_at_one_batch_size_and_are_relative(tmp_path: Path) -> None:
    a100 = load_profile(write_profile(tmp_path, "a100", 2.0))
    v100 = load_profile(write_profile(tmp_path, "v100", 1.0))
    rates = profiled_rates({"a100": a100, "v100": v100})
    assert rates["v100"] == pytest.approx(2 * rates["a100"])
    assert rates["v100"] == pytest.approx(1 / 0.03377243033333303)  # the largest batch size both measured: 1024
    # relative to each other (geometric mean 1); a type without a profile gets the default 1
    prior = prior_capability(("a100", "k80", "v100"), rates)
    assert prior == pytest.approx({"a100": 2**-0.5, "k80": 1.0, "v100": 2**0.5})
    assert prior_capability(("a100",), {}) == {"a100": 1.0}
    # the job's observation wins over the profile; the type it did not run on keeps the profile's ratio
    seen = estimated_capability(("a100", "v100"), {"a100": 10.0}, rates)
    assert seen == pytest.approx({"a100": 10.0, "v100": 20.0})
    assert estimated_capability(("a100", "v100"), {"a100": 10.0, "v100": 10.0}, rates) == pytest.approx(
        {"a100": 10.0, "v100": 10.0}
    )
    # no batch size in common: no rates
    few = a100.model_copy(update={"points": a100.points[:1], "gamma": None})
    with pytest.raises(ValueError, match="share no measured batch size"):
        profiled_rates({"a100": few, "v100": v100.model_copy(update={"points": v100.points[1:2], "gamma": None})})
    with pytest.raises(ValueError, match="finite and positive"):
        prior_capability(("a100",), {"a100": float("inf")})


def test_the_lookup_reads_the_models_profile_per_type_and_refuses_hostile_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "profiles"
    write_profile(directory, "a100", 2.0)
    write_profile(directory, "v100", 1.0)
    lookup = profile_capability(directory)
    rates = dict(lookup("mlp@a100", ("a100", "k80", "v100")))
    assert set(rates) == {"a100", "v100"} and rates["v100"] == pytest.approx(2 * rates["a100"])
    assert lookup("nothing@a100", ("a100", "v100")) == ()  # no such profile: no rates, no warning
    assert lookup("../x", ("a100",)) == ()  # not a name
    assert "nothing" not in caplog.text
    hostile = {
        "not JSON": b"{",
        "a schema the reader does not know": json.dumps({"schema_version": 99}).encode(),
        "an extra field": json.dumps({**json.loads((directory / "mlp@v100.json").read_text()), "x": 1}).encode(),
        "nested too deep": b"[" * 200_000,
        "too large": b" " * (2 << 20),
    }
    for why, data in hostile.items():
        (directory / "mlp@v100.json").write_bytes(data)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            got = dict(lookup("mlp@a100", ("a100", "v100")))
            assert lookup("mlp@a100", ("a100", "v100")) == tuple(got.items())  # the second pass: no new warning
        assert set(got) == {"a100"}, why  # the bad file is no profile; a100 alone is still profiled
        assert len(caplog.records) == 1 and "mlp@v100" in caplog.text, why
    # a link, or a profile of another model or type under the name, is none either
    (directory / "mlp@v100.json").unlink()
    (directory / "mlp@v100.json").symlink_to(write_profile(tmp_path / "elsewhere", "v100", 1.0))
    assert dict(lookup("mlp@a100", ("a100", "v100"))).keys() == {"a100"}
    (directory / "mlp@v100.json").unlink()
    write_profile(directory, "v100", 1.0).write_text((directory / "mlp@a100.json").read_text())
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert dict(lookup("mlp@a100", ("a100", "v100"))).keys() == {"a100"}
    assert "is not of model 'mlp' on 'v100'" in caplog.text
    # the named profile itself unreadable: no rates at all
    (directory / "mlp@a100.json").write_text("[]")
    assert lookup("mlp@a100", ("a100", "v100")) == ()


def _daemon(tmp_path: Path, slurm_data: Path, profiles: Path) -> tuple[Daemon, Job]:
    """Job 12 as an elastic job of 8 ESTs at D2 on node1's 2 a100, naming profile ``mlp@a100``; node1's other 2 a100
    and 2 of node3's v100 idle, the other GPUs held by fillers."""
    jobs, nodes = _captured(slurm_data)
    job = _elastic_on_node1(jobs, D2)
    fillers = [j for j in jobs if j.job_id in {9, 11}]
    fillers.append(replace(next(j for j in jobs if j.job_id == 10), gpus=GpuCounts.of({"v100": 2})))
    used = {"node1": {"a100": 2}, "node2": {"a100": 4}, "node3": {"v100": 2}, "node4": {"v100": 4}}
    seen: list[Node] = [replace(n, gpus_allocated=GpuCounts.of(used[n.name])) if n.name in used else n for n in nodes]
    cfg = config(tmp_path, policy="tiresias-las+easyscale", resize={"enabled": True}, preemption={"min_run_time_s": 0})
    record(JobDir.of(tmp_path / "jobs", job.name, job.job_id).prepare(), job.restart_count, (), d2=True)
    assert job.start_time is not None
    clock = Clock((job.start_time + timedelta(seconds=600)).timestamp())
    daemon = Daemon(
        cfg,
        FakeSlurm([job, *fillers], seen),
        Store(cfg.state_dir),
        clock=clock,
        sleep=clock.sleep,
        capability_lookup=profile_capability(profiles),
    )
    return daemon, job


def _grow(daemon: Daemon) -> tuple[dict[str, float], Resize]:
    report = daemon.run_pass()
    assert report.observation is not None
    (model,) = [v.scaling for v in report.observation.jobs if v.job_id == 12]
    assert isinstance(model, EstProfile) and model.mixed
    (grow,) = [a for a in report.actions if isinstance(a, Resize)]
    return dict(model.capability), grow


def test_a_profile_that_says_v100_is_twice_a100_gives_the_job_the_v100(tmp_path: Path, slurm_data: Path) -> None:
    """8 ESTs on 2 a100; 2 a100 and 2 v100 idle. At equal C_i (no profile) Role 2's proposals of 2 a100 and of
    2 v100 tie (Eq. 1d: 2 ESTs a GPU, twice the throughput) and the job grows to 4 a100; a 6th GPU adds nothing.
    With the profiles saying a v100 runs the model twice as fast as an a100, 2 v100 win (Eq. 1d: 1 EST on each
    a100 and 3 on each v100, 8 / 1.5 against 8 / 2), then 2 a100 more pay too (1 EST on each a100, 2 on each
    v100): 6 GPUs."""
    profiles = tmp_path / "profiles"
    daemon, _ = _daemon(tmp_path / "plain", slurm_data, profiles)
    capability, grow = _grow(daemon)
    assert capability == {"a100": 1.0, "v100": 1.0}
    assert (grow.old_gpus, grow.new_gpus, grow.split) == (2, 4, (("a100", 4),))
    write_profile(profiles, "a100", 2.0)
    write_profile(profiles, "v100", 1.0)
    daemon, _ = _daemon(tmp_path / "profiled", slurm_data, profiles)
    capability, grow = _grow(daemon)
    assert capability == pytest.approx({"a100": 2**-0.5, "v100": 2**0.5})
    assert (grow.old_gpus, grow.new_gpus, grow.split) == (2, 6, (("a100", 4), ("v100", 2)))
    # a hostile v100 file: the default for v100, the plan of equal C_i
    (profiles / "mlp@v100.json").write_text('{"schema_version": 1, "name": "mlp@v100"}')
    daemon, _ = _daemon(tmp_path / "hostile", slurm_data, profiles)
    capability, grow = _grow(daemon)
    assert capability == pytest.approx({"a100": 1.0, "v100": 1.0})
    assert (grow.old_gpus, grow.new_gpus, grow.split) == (2, 4, (("a100", 4),))
