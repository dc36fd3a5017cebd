"""Side by side: the public Tiresias simulator and our reference model (``--model reference``), avg JCT per policy.

Runs SymbioticLab/Tiresias's ``simulator/`` (Python 2.7; ``--reference`` names a checkout, ``--python2`` the
interpreter) and :class:`hpc_elastic.sim.engine.Simulator` with ``SimModel.REFERENCE`` on the same traces:

- our development traces, read with our loaders (:func:`hpc_elastic.sim.trace.load_trace`) and compressed with
  ``--load-scale``, are written in the reference's CSV format with integer seconds (it keeps integers), and our
  side replays that converted file, so both simulators see the same jobs;
- both use 2 queues split at 3,200 GPU-s (ours by default; the reference's defaults are 3 queues and 3,250, set
  by the driver) and ``--scheme=count`` (GPUs counted, no placement, no preemption cost);
- 2D-Gittins uses the job-size distribution the reference's index is computed from (its ``yarn-gput1000.csv``).

Policies: fifo = ``fifo``, srtf = ``shortest``, tiresias-las = ``dlas-gpu``, tiresias-gittins = ``dlas-gpu-gittins``.

The reference runs unchanged in its decisions. Its bookkeeping is quadratic in places (linear searches in event
lists, dict comparisons when it re-queues pending jobs, a log file written per completion): the driver written
next to a copy of it replaces these with equivalents (see ``PATCHES`` and ``DRIVER``); ``--unpatched`` runs the
copy as it is (slow past a few thousand jobs) to check that the replacements change nothing.

Default: the Tiresias 60-job trace on 15x4 at load scales 4 and 8, Pollux workloads 1-8 on 16x4 at 1 and 2, the
Alibaba openb pods on 4x8 at 1 and 2 (seconds per run); ``--synthetic N`` adds an N-job synthetic trace (yarn
sizes, 64x8, nominal load 2; the reference takes tens of minutes per policy at 80,000 jobs). Prints the table and
ends with one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from hpc_elastic.policy import ServiceDistribution, make_policy
from hpc_elastic.sim.cluster import parse_cluster_spec
from hpc_elastic.sim.engine import SimConfig, SimModel, Simulator
from hpc_elastic.sim.metrics import summarize
from hpc_elastic.sim.synth import load_sizes, synthesize
from hpc_elastic.sim.trace import TraceJob, load_trace

REPO = Path(__file__).resolve().parents[1]
#: our policy -> the reference's ``--schedule``
SCHEDULES: dict[str, str] = {
    "fifo": "fifo",
    "srtf": "shortest",
    "tiresias-las": "dlas-gpu",
    "tiresias-gittins": "dlas-gpu-gittins",
}
THRESHOLD = 3200  # GPU-seconds between the two queues (our DEFAULT_THRESHOLDS)
#: the models the reference's models.py knows (it builds per-tensor network sizes from them even under
#: ``--scheme=count``, where they decide nothing); other models are written as resnet50
REFERENCE_MODELS = frozenset(
    ("vgg19", "vgg16", "vgg11", "alexnet", "resnet152", "resnet101", "resnet50", "inception4", "inception3")
)

# Replacements in the copy of the reference's run_sim.py: (what, pattern, replacement, expected matches).
# Each replaces a computation by one with the same result, so no decision changes:
PATCHES: tuple[tuple[str, str, str, int], ...] = (
    (
        # smallest_first / shortest_first rebuild their end events after every event, looking each end time up by
        # a linear search of the list being built: a dict from time to the same entry finds the same entry.
        "end-time index",
        r"(\n( +)del end_events\[:\]\n)(?=( +)for rjob in JOBS\.runnable_jobs:\n.*\n.*\n +tmp_dict = util\.search)",
        r"\1\2end_index = dict()\n",
        2,
    ),
    (
        "end-time lookup",
        r"\n( +)tmp_dict = util\.search_dict_list\(end_events, 'time', end_time\)\n",
        r"\n\1tmp_dict = end_index.get(end_time)\n",
        2,
    ),
    (
        "end-time insert",
        r"\n( +)end_events\.append\(tmp_dict\)\n",
        r"\n\1end_events.append(tmp_dict)\n\1end_index[end_time] = tmp_dict\n",
        2,
    ),
    (
        # The MLFQ loops move a queue's pending jobs behind its running ones with one list.remove per job, which
        # compares job dicts field by field: quadratic. Pending jobs are those the loop just collected in queue
        # order, and distinct jobs never compare equal (distinct job ids), so one stable partition is the same list.
        "pending jobs to the tail",
        r"\n( +)for job in pending_job: \n +queue\.remove\(job\)\n +queue\.extend\(pending_job\)\n",
        r"\n\1queue[:] = [job for job in queue if job['status'] != 'PENDING'] + pending_job\n",
        3,
    ),
    (
        # get_gittins_index: the first index whose sample exceeds a, by a linear scan of the sorted samples (sorted
        # in parse_job_dist, sys.maxint last; a is below the second-to-last sample here): bisect_right finds it.
        "Gittins index lookup",
        r"\n    idx = next\(x\[0\] for x in enumerate\(job_info\['data'\]\) if x\[1\] > a\)\n",
        r"\n    idx = bisect.bisect_right(job_info['data'], a)\n",
        1,
    ),
    ("import bisect", r"\nimport copy\n", r"\nimport copy\nimport bisect\n", 1),
)

# Modules the reference imports and does not use with --scheme=count: numpy (only for placements we do not run) and
# cplex (its LP-based 'balance' placement).
STUBS: dict[str, str] = {
    "numpy.py": "# stub: not used with --scheme=count\n",
    "cplex/__init__.py": "# stub: the 'balance' placement's LP solver, not used with --scheme=count\n",
    "cplex/exceptions.py": "class CplexError(Exception):\n    pass\n",
    "cplex/six/__init__.py": "",
    "cplex/six/moves/__init__.py": "range = range\n",
}

# The driver, run by Python 2.7 in the copy of the reference's simulator directory. It sets the queues and runs
# run_sim.main() unchanged in its decisions; what it replaces only records or finds things:
# - the event list (a list of {'time', 'start_jobs', 'end_jobs'} kept sorted by time and searched linearly) by a
#   dict plus a sorted list of times with the same indexing, pop and len (its sort() is a no-op: always sorted);
# - LOG.checkpoint (a cluster snapshot written per event) by nothing, LOG.job_complete (a CSV rewritten per
#   completion) by a row kept in memory, setting job['end_time'] as the original does.
# usage: driver.py SIMDIR TRACE SPEC SCHEDULE THRESHOLD LOGDIR [--unpatched]  (--unpatched keeps its event list)
DRIVER = r"""
from __future__ import print_function
import bisect
import json
import os
import sys

simdir, trace, spec, schedule, threshold, logdir = sys.argv[1:7]
unpatched = '--unpatched' in sys.argv[7:]
threshold = int(threshold)
sys.argv = [sys.argv[0], '--cluster_spec=' + spec, '--scheme=count', '--trace_file=' + trace,
            '--schedule=' + schedule, '--log_path=' + logdir]
sys.path.insert(0, simdir)
os.chdir(simdir)  # parse_job_dist reads yarn-gput1000.csv from the working directory
import run_sim, jobs, log

JOBS = jobs.JOBS
JOBS.num_queue = 2
JOBS.queues = [list() for _ in range(2)]
JOBS.queue_limit = [threshold]
JOBS.gittins_delta = threshold


class EventList(object):
    def __init__(self):
        self.times = []
        self.by_time = {}

    def get(self, t):
        ev = self.by_time.get(t)
        if ev is None:
            ev = {'time': t, 'start_jobs': [], 'end_jobs': []}
            self.by_time[t] = ev
            bisect.insort(self.times, t)
        return ev

    def __len__(self):
        return len(self.times)

    def __getitem__(self, i):
        return self.by_time[self.times[i]]

    def pop(self, i=-1):
        return self.by_time.pop(self.times.pop(i))

    def sort(self, key=None):
        pass


def prepare_job_start_events():
    ev = EventList()
    for job in JOBS.job_list:
        ev.get(job['submit_time'])['start_jobs'].append(job)
        job['status'] = 'EVENT'
    JOBS.job_events = ev


def add_job_end_event(job):
    JOBS.job_events.get(job['end_time'])['end_jobs'].append(job)


ROWS = []


def job_complete(job, event_time):
    job['end_time'] = event_time
    ROWS.append((job['submit_time'], event_time, job['preempt']))


if not unpatched:
    JOBS.prepare_job_start_events = prepare_job_start_events
    JOBS.add_job_end_event = add_job_end_event
log.LOG.checkpoint = lambda event_time: None
log.LOG.job_complete = job_complete

real_stdout = sys.stdout
sys.stdout = open(os.devnull, 'w')
run_sim.main()
sys.stdout = real_stdout
jct = [end - submit for (submit, end, _) in ROWS]
print(json.dumps({
    'schedule': schedule, 'jobs': len(JOBS.job_list), 'finished': len(jct),
    'avg_jct': float(sum(jct)) / len(jct) if jct else None,
    'preemptions': sum(r[2] for r in ROWS),
}))
"""


@dataclass(frozen=True, slots=True)
class Case:
    label: str
    jobs: tuple[TraceJob, ...]
    nodes: int
    gpus_per_node: int


def fail(message: str) -> NoReturn:
    print(f"sched_reference: {message}", file=sys.stderr)
    sys.exit(2)


def simulator_dir(reference: Path) -> Path | None:
    """The reference's simulator directory: DIR/simulator (a checkout) or DIR itself."""
    for candidate in (reference / "simulator", reference):
        if (candidate / "run_sim.py").is_file() and (candidate / "yarn-gput1000.csv").is_file():
            return candidate
    return None


def patch_run_sim(text: str) -> str:
    for what, pattern, replacement, expected in PATCHES:
        text, found = re.subn(pattern, replacement, text)
        if found != expected:
            fail(
                f"the reference's run_sim.py differs from SymbioticLab/Tiresias@959f9b0 ({what}: {found} matches, "
                f"expected {expected}); try --unpatched"
            )
    return text


def prepare(simdir: Path, work: Path, unpatched: bool) -> Path:
    """A copy of the reference's simulator (patched unless ``unpatched``), the stubs and the driver under work."""
    copy = work / "simulator"
    shutil.copytree(simdir, copy, ignore=shutil.ignore_patterns("*.pyc", "result-*"))
    if not unpatched:
        run_sim = copy / "run_sim.py"
        run_sim.write_text(patch_run_sim(run_sim.read_text(encoding="utf-8")), encoding="utf-8")
    for name, text in STUBS.items():
        path = work / "stubs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    (work / "driver.py").write_text(DRIVER, encoding="utf-8")
    return copy


def write_reference_trace(jobs: tuple[TraceJob, ...], path: Path) -> None:
    """The jobs in the reference's CSV: submission order, integer seconds, durations >= 1 s."""
    lines = ["job_id,num_gpu,submit_time,iterations,model_name,duration,interval"]
    for i, job in enumerate(sorted(jobs, key=lambda j: (j.submit, j.line))):
        model = job.model if job.model in REFERENCE_MODELS else "resnet50"
        duration = max(1, round(job.duration))
        lines.append(f"{i},{job.gpus},{round(job.submit)},1,{model},{duration},0")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@dataclass(frozen=True, slots=True)
class Reference:
    """The prepared reference: its interpreter, the work directory and the copy of its simulator."""

    python2: Path
    work: Path
    copy: Path
    unpatched: bool


def run_reference(ref: Reference, trace: Path, spec: Path, schedule: str) -> dict[str, float]:
    work = ref.work
    cmd = [str(ref.python2), str(work / "driver.py"), str(ref.copy), str(trace), str(spec), schedule, str(THRESHOLD)]
    cmd.append(str(work / "logs"))
    if ref.unpatched:
        cmd.append("--unpatched")
    env = {**os.environ, "PYTHONPATH": str(work / "stubs")}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        fail(f"the reference failed on {trace.name} --schedule={schedule}: {tail}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run_ours(trace: Path, case: Case, policy: str, history: ServiceDistribution) -> dict[str, float]:
    jobs = load_trace(trace, "tiresias").jobs
    nodes = parse_cluster_spec(f"{case.nodes}x{case.gpus_per_node}")
    config = SimConfig(model=SimModel.REFERENCE, history=history)
    m = summarize(Simulator(jobs, nodes, make_policy(policy), config).run())
    return {"avg_jct": m["avg_jct"], "finished": m["finished"], "preemptions": m["preemptions"]}


def parse_list(text: str, convert: Callable[[str], float]) -> list[float]:
    if not text:
        return []
    if "-" in text and "," not in text:
        lo, hi = (int(x) for x in text.split("-"))
        return [float(x) for x in range(lo, hi + 1)]
    return [convert(x) for x in text.split(",")]


def cases(args: argparse.Namespace, sizes: list[float]) -> list[Case]:
    traces: Path = args.traces
    out: list[Case] = []
    tiresias = load_trace(traces / "tiresias_60_job.csv", "tiresias")
    for load in parse_list(args.tiresias_loads, float):
        out.append(Case(f"tiresias60 x{load:g}", tiresias.scaled(load).jobs, 15, 4))
    for load in parse_list(args.pollux_loads, float):
        for number in parse_list(args.workloads, int):
            trace = load_trace(traces / "pollux_workloads" / f"workload-{number:g}.csv", "pollux")
            out.append(Case(f"pollux{number:g} x{load:g}", trace.scaled(load).jobs, 16, 4))
    openb = traces / "alibaba_openb" / "openb_pod_list_default.csv"
    for load in parse_list(args.openb_loads, float):
        out.append(Case(f"openb x{load:g}", load_trace(openb, "openb").scaled(load).jobs, 4, 8))
    if args.synthetic:
        jobs = synthesize(sizes, args.synthetic, 512, load=2.0, seed=1)
        out.append(Case(f"synthetic{args.synthetic} load 2", jobs, 64, 8))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, required=True, help="checkout of SymbioticLab/Tiresias")
    parser.add_argument("--python2", type=Path, required=True, help="Python 2.7 interpreter")
    parser.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "traces")
    parser.add_argument("--tiresias-loads", default="4,8", help="load scales of the 60-job trace ('' to skip)")
    parser.add_argument("--pollux-loads", default="1,2", help="load scales of the Pollux workloads ('' to skip)")
    parser.add_argument("--workloads", default="1-8", help="Pollux workloads, e.g. 1-8 or 1,3")
    parser.add_argument("--openb-loads", default="1,2", help="load scales of the openb pods ('' to skip)")
    parser.add_argument("--synthetic", type=int, default=0, help="jobs of a synthetic trace (0: none)")
    parser.add_argument("--policies", default=",".join(SCHEDULES), help="comma-separated subset")
    parser.add_argument("--unpatched", action="store_true", help="run the reference without the bookkeeping patches")
    args = parser.parse_args()
    simdir = simulator_dir(args.reference)
    if simdir is None:
        fail(f"no Tiresias simulator (simulator/run_sim.py) in --reference {args.reference}")
    if not (args.python2.is_file() and os.access(args.python2, os.X_OK)):
        fail(f"--python2 {args.python2} is not an executable file")
    probe = subprocess.run(
        [str(args.python2), "-c", "import sys; print(sys.version_info[0])"], capture_output=True, text=True, check=False
    )
    if probe.stdout.strip() != "2":
        fail(f"--python2 {args.python2} is not a Python 2 interpreter")
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in SCHEDULES]
    if unknown:
        fail(f"no reference schedule for {', '.join(unknown)} (choose from {', '.join(SCHEDULES)})")
    sizes = load_sizes(simdir / "yarn-gput1000.csv")
    history = ServiceDistribution.from_samples(sizes)
    started = time.perf_counter()
    rows: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="sched-reference-") as tmp:
        work = Path(tmp)
        reference = Reference(args.python2, work, prepare(simdir, work, args.unpatched), args.unpatched)
        header = " | ".join(f"{p}: reference / ours / Δ" for p in policies)
        print(f"| trace | {header} |")
        print("|---|" + "---|" * len(policies))
        for case in cases(args, sizes):
            trace = work / "trace.csv"
            write_reference_trace(case.jobs, trace)
            spec = work / "cluster.csv"
            spec.write_text(
                "num_switch,num_node_p_switch,num_gpu_p_node,num_cpu_p_node,mem_p_node\n"
                f"1,{case.nodes},{case.gpus_per_node},128,256\n",
                encoding="utf-8",
            )
            row: dict[str, dict[str, float]] = {}
            cells = [f"{case.label} ({len(case.jobs)} jobs, {case.nodes}x{case.gpus_per_node})"]
            for policy in policies:
                t = time.perf_counter()
                ref = run_reference(reference, trace, spec, SCHEDULES[policy])
                ref_s = time.perf_counter() - t
                t = time.perf_counter()
                ours = run_ours(trace, case, policy, history)
                ours_s = time.perf_counter() - t
                delta = (ours["avg_jct"] - ref["avg_jct"]) / ref["avg_jct"] * 100
                row[policy] = {
                    "reference": ref["avg_jct"],
                    "ours": ours["avg_jct"],
                    "delta_pct": round(delta, 3),
                    "reference_finished": ref["finished"],
                    "ours_finished": ours["finished"],
                    "reference_preemptions": ref["preemptions"],
                    "ours_preemptions": ours["preemptions"],
                    "reference_s": round(ref_s, 2),
                    "ours_s": round(ours_s, 2),
                }
                cells.append(f"{ref['avg_jct']:,.0f} / {ours['avg_jct']:,.0f} / {delta:+.1f} %")
            print("| " + " | ".join(cells) + " |", flush=True)
            rows[case.label] = row
    deltas = [abs(cell["delta_pct"]) for row in rows.values() for cell in row.values()]
    worst = max(deltas, default=0.0)
    mean = sum(deltas) / len(deltas) if deltas else 0.0
    print(f"max |Δ| {worst:.2f} %, mean |Δ| {mean:.2f} % over {len(deltas)} (trace, policy) cells")
    summary = {
        "policies": policies,
        "threshold": THRESHOLD,
        "unpatched": args.unpatched,
        "max_abs_delta_pct": round(worst, 3),
        "mean_abs_delta_pct": round(mean, 3),
        "cells": len(deltas),
        "results": rows,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
