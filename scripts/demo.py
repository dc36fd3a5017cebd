"""The demo behind ``make demo``: the issue-4 story on the local Slurm cluster (slurm_plugin.scenario).

1. Starts hpc-elastic-sched (scoped to the demo's jobs), submits a long 2-GPU training job and then two short
   1-GPU ones through ``hpc-elastic submit`` (wrappers/examples/train_mlp.py, a real training loop). Two v100 GPUs
   are left free for them by a filler job the daemon does not manage.
   The long job is demoted (Tiresias 2D-LAS, §3.2.3), preempted with a checkpoint, requeued; the short jobs run;
   the long job resumes from its checkpoint and finishes.
2. Runs the same mix with the plugin off (Slurm's own multifactor/backfill order).
3. Prints a table (JCT per job both ways, average JCT, preemptions), writes ``demo-jct.png`` and
   ``demo-report.json`` in the working directory. Exit status 0 when the story held (the long job was preempted,
   resumed from its checkpoint, and its final parameters equal those of the uninterrupted run).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hpc_elastic.env import read_environment
from hpc_elastic.plotting import pyplot
from hpc_elastic.slurm import connect
from slurm_plugin.scenario import MixConfig, MixResult, ScenarioError, end_order, run_mix

REPORT = Path("demo-report.json")
PLOT = Path("demo-jct.png")


def say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


def report(with_plugin: MixResult, plain: MixResult) -> dict[str, Any]:
    names = sorted(with_plugin.jobs, key=lambda n: (n != "long", n))
    jobs = []
    for name in names:
        a, b = with_plugin.jobs[name], plain.jobs[name]
        jobs.append(
            {
                "name": name,
                "jct_plugin_s": round(a.jct, 1),
                "jct_plain_s": round(b.jct, 1),
                "preemptions_plugin": a.preemptions,
                "preemptions_plain": b.preemptions,
                "resumed_from_checkpoint": a.resumed_from_checkpoint,
                "resumed_at_step": a.start_step if a.resumed_from_checkpoint else None,
                "final_params_sha256_plugin": a.sha256,
                "final_params_sha256_plain": b.sha256,
            }
        )
    long_plugin, long_plain = with_plugin.jobs["long"], plain.jobs["long"]
    return {
        "jobs": jobs,
        "avg_jct_plugin": round(with_plugin.avg_jct, 1),
        "avg_jct_plain": round(plain.avg_jct, 1),
        "preempted_result_identical": long_plugin.preemptions > 0
        and long_plain.preemptions == 0
        and long_plugin.sha256 == long_plain.sha256,
        "end_order_plugin": end_order(with_plugin),
        "end_order_plain": end_order(plain),
        "daemon_actions": [
            {k: a[k] for k in ("kind", "job_id", "ok", "detail", "reason")}
            for a in with_plugin.daemon_actions
            if a["kind"] != "order"
        ],
        "workdirs": {"plugin": with_plugin.workdir, "plain": plain.workdir},
    }


def table(doc: dict[str, Any]) -> None:
    out = Table(
        title="job completion time (JCT = end - first submission), with and without hpc-elastic-sched",
        caption="Slurm resets a job's submit time on requeue; the first one is recorded at submission",
    )
    for column in ("job", "JCT plugin (s)", "JCT plain (s)", "preemptions (plugin)", "resumed from checkpoint"):
        out.add_column(column)
    for job in doc["jobs"]:
        out.add_row(
            job["name"],
            f"{job['jct_plugin_s']:.0f}",
            f"{job['jct_plain_s']:.0f}",
            str(job["preemptions_plugin"]),
            f"yes (step {job['resumed_at_step']})" if job["resumed_from_checkpoint"] else "no",
        )
    out.add_row("average", f"{doc['avg_jct_plugin']:.0f}", f"{doc['avg_jct_plain']:.0f}", "", "")
    Console(width=140).print(out)


def plot(doc: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    names = [j["name"] for j in doc["jobs"]] + ["average"]
    plugin = [j["jct_plugin_s"] for j in doc["jobs"]] + [doc["avg_jct_plugin"]]
    plain = [j["jct_plain_s"] for j in doc["jobs"]] + [doc["avg_jct_plain"]]
    xs = range(len(names))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([x - 0.2 for x in xs], plugin, width=0.4, label="hpc-elastic-sched (Tiresias 2D-LAS)")
    ax.bar([x + 0.2 for x in xs], plain, width=0.4, label="plain Slurm")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("job completion time (s)")
    ax.set_title("Same mix on the dev cluster, measured")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    env = read_environment()
    slurm = connect(env)
    root = env.gpfs_root / "demo"
    root.mkdir(parents=True, exist_ok=True)
    mix = MixConfig()
    try:
        say("== 1/2: the mix with hpc-elastic-sched")
        with_plugin = run_mix(slurm, root, mix, plugin=True, say=say)
        for action in with_plugin.daemon_actions:
            if action["kind"] in ("preempt", "requeue", "resize", "size", "place"):
                say(f"daemon: {action['kind']} job {action['job_id']}: {action['detail']} ({action['reason']})")
        say("== 2/2: the same mix, plugin off")
        plain = run_mix(slurm, root, mix, plugin=False, say=say)
    except ScenarioError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    doc = report(with_plugin, plain)
    table(doc)
    plot(doc, PLOT)
    REPORT.write_text(json.dumps(doc, indent=1) + "\n")
    say(
        f"order of completion with the plugin: {' < '.join(doc['end_order_plugin'])}; "
        f"without: {' < '.join(doc['end_order_plain'])}"
    )
    say(f"preempted job's final parameters identical to the uninterrupted run: {doc['preempted_result_identical']}")
    say(f"wrote {REPORT.resolve()} and {PLOT.resolve()}")
    return 0 if doc["preempted_result_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
