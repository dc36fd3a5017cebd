"""hpc-elastic-sched under ``tiresias-las+easyscale`` on the real dev cluster: one job across GPU types.

The story is ``make demo``'s second act (:mod:`slurm_plugin.grow_story`, :meth:`GrowConfig.beside_a_d1_job`): in
partition ``gpu`` (node1-2 a100, node3-4 v100) plain fillers hold all GPUs but node1's and node2's last 2 a100 and,
once the two elastic jobs run, node3's last 2 v100; two elastic jobs of N = 8 logical workers (ESTs) start on 2
a100 each, elastic between 2 and 4 GPUs, submitted without a GPU type:

- the bundled example's MLP at D2 (the model scanner covers it; its run reports D2 to the daemon): EasyScale's
  proposals grow it into node3's 2 idle v100, a plan across types (Eq. 1d: 8 ESTs on 2 a100 + 2 v100, 2 each,
  twice the throughput of 4 each on 2 a100), which the daemon gives the requeued job as nodes (node lists that
  Slurm's block fill turns into 2 a100 + 2 v100, the same job id); then a 2-GPU gang job of any type arrives and
  2D-LAS, counting the elastic job at its minimum, lets it in: the elastic job shrinks back to 2 GPUs of one type,
  the plan's (Role 1's top-1 on the capability per type its run measured: on the dev cluster's fake GPUs every type
  runs the same code on the same CPUs, so which is measured faster is noise, and either may be kept), the daemon
  holds their node for it while it is requeued, and the gang job gets the two it gave up. Its final parameters
  are, bit for bit, those of one uninterrupted 1-process run at D2;
- the example's BatchNorm + Dropout model, which D2 does not cover, at D1: it stays on its a100, never resized
  while the D2 job holds a100, never given a v100.

The test asserts the order of events and the values Slurm and the jobs report, never durations.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpc_elastic.slurm import CliSlurm, JobState
from slurm_plugin.grow_story import GrowConfig, run_grow_story

pytestmark = pytest.mark.integration


@pytest.mark.timeout(900)
def test_easyscale_grows_a_d2_job_across_gpu_types_and_shrinks_it_back_to_one_type_for_a_gang_job(
    slurm: CliSlurm, lane_root: Path
) -> None:
    cfg = GrowConfig.beside_a_d1_job()
    result = run_grow_story(slurm, lane_root, cfg)
    where = f"(see {result.workdir})"
    elastic, gang, bystander = result.elastic_id, result.gang_id, result.bystander_id
    every = [a for a in result.daemon_actions if a["kind"] == "resize"]
    resizes = [a for a in every if a["job_id"] == elastic]
    assert len(resizes) >= 2 and all(a["ok"] for a in resizes), every
    assert str(resizes[0]["reason"]).startswith("grow into GPUs no waiting job can use")
    assert str(resizes[0]["reason"]).endswith("(2 a100 + 2 v100)"), resizes
    shrink = re.fullmatch(r"shrink: the policy's elastic share is 2 GPUs \(2 (a100|v100)\)", str(resizes[1]["reason"]))
    assert shrink is not None, resizes
    kept = shrink.group(1)  # the plan's type: the one the job's run measured faster (noise on fake GPUs)
    # the D2 job: 2 a100 -> 2 a100 + 2 v100 (one job id, one job on both types, two nodes) -> 2 GPUs of the plan's
    # type, on the node of those it held (the daemon held it across the requeue); the gang job got the other two
    assert result.grown_gpus == (("a100", 2), ("v100", 2)) and len(result.grown_nodes) == 2, where
    held = result.grown_nodes[0 if kept == "a100" else 1]  # Slurm's order puts the a100 nodes first
    assert result.shrunk_gpus == ((kept, 2),) and result.shrunk_nodes == (held,), where
    assert result.gang_nodes == tuple(n for n in result.grown_nodes if n != held), where
    # (once the gang job has ended, the daemon may grow the job into the idle GPUs again: it has steps left)
    assert [s.split(")")[0] for s in result.starts[:3]] == [
        "rank 0 of 2 (torch, cpu, a100",
        "rank 0 of 4 (torch, cpu, a100+v100",
        f"rank 0 of 2 (torch, cpu, {kept}",
    ], where
    # the gang job (not elastic) is never resized, stopped or placed by the daemon
    assert not [a for a in result.daemon_actions if a["job_id"] == gang and a["kind"] != "order"], where
    assert result.identical, (result.elastic_sha, result.reference_sha, where)
    assert result.daemon_exit == 0, where  # SIGTERM: the daemon ended its pass and exited cleanly
    # the model D2 does not cover: on its 2 a100 while the D2 job held a100, while v100 were idle and the other job
    # took them; the daemon may grow it once the D2 job has left the a100 (ended, or shrunk onto v100 when its
    # measured speedup on 4 fake GPUs sharing the host's cores lost the greedy to this job's proposal), never across
    # types
    ended = min(s.t for s in result.samples if s.job_id == elastic and s.state is JobState.COMPLETED)
    off_a100 = [a["time"] for a in resizes if "a100" not in str(a["reason"])]
    a100_left = min([ended, *off_a100])
    mine = [s for s in result.samples if s.job_id == bystander]
    began = min(s.t for s in mine if s.state is JobState.RUNNING)
    seen = [s for s in mine if began <= s.t < a100_left]
    assert seen and all(s.state is JobState.RUNNING and s.restart_count == 0 for s in seen), where
    assert all(s.gpus == (("a100", 2),) for s in seen), where
    assert all("v100" not in str(a["reason"]) for a in every if a["job_id"] == bystander), every
    assert result.bystander_starts[0].startswith("rank 0 of 2 (torch, cpu, a100)"), where
    assert all("v100" not in s for s in result.bystander_starts), where
