"""The demo behind ``make demo``: two stories of the scheduler on the local Slurm cluster, one act each.

Act 1 (slurm_plugin.scenario): Tiresias' preemption.

1. Starts hpc-elastic-sched (scoped to the demo's jobs), submits a long 2-GPU training job and then two short
   1-GPU ones through ``hpc-elastic submit`` (wrappers/examples/train_mlp.py, a real training loop). Two v100 GPUs
   are left free for them by a filler job the daemon does not manage.
   The long job is demoted (Tiresias 2D-LAS, §3.2.3), preempted with a checkpoint, requeued; the short jobs run;
   the long job resumes from its checkpoint and finishes.
2. Runs the same mix with the plugin off (Slurm's own multifactor/backfill order).
3. Prints a table (JCT per job both ways, average JCT, preemptions), writes ``demo-jct.png`` and
   ``demo-report.json`` in the working directory. Exit status 0 when the story held (the long job was preempted,
   resumed from its checkpoint, and its final parameters equal those of the uninterrupted run).

Act 2 (slurm_plugin.grow_story): EasyScale in the daemon (``tiresias-las+easyscale``). An elastic N = 8 job at level
D2 starts on 2 a100 and grows onto the idle v100 beside them, one job across GPU types (Role 2's proposals and Eq. 1d,
EasyScale §3.4), shrinks back when a rigid gang job arrives (2D-LAS lets the gang job in), and ends with the same
final parameters as one uninterrupted 1-process run at D2. Writes ``demo-grow.png`` (the GPUs of each type each job
held over time and their total, read from Slurm every second, with the daemon's resize decisions and Slurm's requeues
marked) and ``demo-grow-report.json``. It runs as a ``gpu`` lane session of the integration tests would (it waits for
their locks), since it fills the ``gpu`` partition. Exit status 0 when both acts' stories held.

``--act 1`` or ``--act 2`` runs one act only.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from hpc_elastic.env import read_environment
from hpc_elastic.files import wait_for_lock
from hpc_elastic.plotting import pyplot
from hpc_elastic.slurm import connect
from slurm_plugin.grow_story import GrowConfig, GrowResult, run_grow_story
from slurm_plugin.scenario import MixConfig, MixResult, ScenarioError, end_order, run_mix
from slurm_plugin.timeline import Holding, gpu_types, holdings, resize_actions, restarts

REPORT = Path("demo-report.json")
PLOT = Path("demo-jct.png")
GROW_REPORT = Path("demo-grow-report.json")
GROW_PLOT = Path("demo-grow.png")
#: the integration tests' session locks (tests/integration/conftest.py), under the shared gpfs root
TEST_ROOT_NAME = "tests"
LOCK_WAIT_S = 1800.0


def say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


def timing(name: str, seconds: float) -> None:
    """A phase's time, as scripts/timed says it (and records it for make demo's summary)."""
    print(f"timing: {name} {seconds:.1f} s", flush=True)
    path = os.environ.get("HPC_ELASTIC_TIMINGS")
    if path:
        with open(path, "a") as out:
            out.write(f"{name}|{seconds:.1f}\n")


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


def act1(root: Path) -> bool:
    """The scheduler story, with and without the plugin; whether it held."""
    slurm = connect(read_environment())
    mix = MixConfig()
    say("== act 1, 1/2: the mix with hpc-elastic-sched")
    with_plugin = run_mix(slurm, root, mix, plugin=True, say=say)
    for action in with_plugin.daemon_actions:
        if action["kind"] in ("preempt", "requeue", "resize", "size", "place"):
            say(f"daemon: {action['kind']} job {action['job_id']}: {action['detail']} ({action['reason']})")
    say("== act 1, 2/2: the same mix, plugin off")
    plain = run_mix(slurm, root, mix, plugin=False, say=say)
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
    return bool(doc["preempted_result_identical"])


def grow_plot(result: GrowResult, path: Path) -> None:
    """Stacked step plot of the GPUs of each type held by the elastic and the gang job over time (and their total
    when a job held more than one type), one panel each; the
    daemon's resize decisions (dashed) and Slurm's requeues of the elastic job (dotted) marked on both; below, the
    elastic job's training loss over steps."""
    plt = pyplot()
    series = holdings(result.samples)
    types = gpu_types(series) or [""]
    t0 = result.t0
    end = max((s.t for s in result.samples), default=t0) - t0
    jobs = [(result.elastic_id, "elastic job (N = 8 ESTs)"), (result.gang_id, "gang job (rigid)")]
    fig = plt.figure(figsize=(8, 7.5))
    grid = fig.add_gridspec(3, 1, height_ratios=[1, 1, 1.1], hspace=0.6)
    first = fig.add_subplot(grid[0])
    axes = [first, fig.add_subplot(grid[1], sharex=first)]
    top = 1
    for ax, (job_id, title) in zip(axes, jobs, strict=True):
        hs: list[Holding] = series.get(job_id, [])
        xs = [h.t - t0 for h in hs] + [end]
        below = [0] * len(
            xs
        )  # the types stacked: 2 a100 + 2 v100 shows as two bands, not two lines on top of each other
        for color, gpu_type in enumerate(types):
            ys = [h.count(gpu_type) for h in hs]
            if not any(ys):
                continue
            above = [lo + n for lo, n in zip(below, [*ys, ys[-1]], strict=True)]
            ax.fill_between(
                xs, below, above, step="post", label=gpu_type or "gpu", color=f"C{color}", alpha=0.6, linewidth=0
            )
            below = above
        totals = [sum(n for _, n in h.gpus) for h in hs]
        if totals:
            top = max(top, *totals)
        if len({name for h in hs for name, _ in h.gpus}) > 1:  # a plan across types: its total too
            ax.step(xs, [*totals, totals[-1]], where="post", label="total", color="black", linewidth=1.5)
        ax.set_title(f"{title}: job {job_id}", fontsize=10, loc="left")
        ax.set_ylabel("GPUs held")
    for action in resize_actions(result.daemon_actions, [result.elastic_id]):
        word = action.reason.split(":")[0].split()[0] if action.reason else "resize"
        for ax in axes:
            ax.axvline(action.t - t0, color="tab:red", linestyle="--", linewidth=1)
        axes[0].annotate(
            f"daemon: {word}", (action.t - t0, 0.15), color="tab:red", fontsize=8, rotation=90, ha="right", va="bottom"
        )
    for t, _count in restarts(result.samples).get(result.elastic_id, []):
        for ax in axes:
            ax.axvline(t - t0, color="grey", linestyle=":", linewidth=1)
    for ax in axes:
        ax.set_ylim(0, top + 1)
        ax.set_yticks(range(top + 1))
        ax.legend(loc="upper right", fontsize=8, title="GPU type", title_fontsize=8)
    axes[1].set_xlabel("seconds since the act began (dashed: the daemon's resize; dotted: Slurm's requeue)")
    loss = fig.add_subplot(grid[2])
    if result.loss:
        loss.plot([step for step, _ in result.loss], [value for _, value in result.loss], color="tab:green")
    loss.set_title("elastic job: training loss (mean over its 8 ESTs) after each step", fontsize=10, loc="left")
    loss.set_xlabel("step")
    loss.set_ylabel("loss")
    fig.suptitle("EasyScale in hpc-elastic-sched (tiresias-las+easyscale), measured on the dev cluster")
    fig.savefig(path, dpi=100)
    plt.close(fig)


@contextlib.contextmanager
def gpu_lane(gpfs_root: Path) -> Iterator[None]:
    """Hold the integration tests' locks as a ``gpu`` lane session does: ``.session.lock`` shared, ``.lane-gpu.lock``
    alone; waits up to :data:`LOCK_WAIT_S` for them (another session's GPUs would starve the story)."""
    test_root = gpfs_root / TEST_ROOT_NAME
    test_root.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as held:
        for name, how in ((".session.lock", fcntl.LOCK_SH), (".lane-gpu.lock", fcntl.LOCK_EX)):
            lock = held.enter_context((test_root / name).open("a"))
            busy = f"waiting for {lock.name} (an integration test session holds it)"
            if not wait_for_lock(lock, how, LOCK_WAIT_S, on_wait=functools.partial(say, busy)):
                raise ScenarioError(f"another session held {lock.name} for {LOCK_WAIT_S:.0f} s")
        yield


def act2(root: Path) -> bool:
    """EasyScale's grow-and-shrink story; whether it held (the final parameters are the reference's)."""
    env = read_environment()
    slurm = connect(env)
    say("== act 2: an elastic N=8 D2 job under tiresias-las+easyscale grows from 2 a100 onto idle v100 (one job")
    say("   across GPU types), shrinks for a gang job")
    with gpu_lane(env.gpfs_root):
        result = run_grow_story(slurm, root, GrowConfig(), say=say)
    for action in result.daemon_actions:
        if action.get("kind") in ("resize", "size", "preempt", "requeue"):
            say(f"daemon: {action['kind']} job {action['job_id']}: {action['detail']} ({action['reason']})")
    GROW_REPORT.write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    grow_plot(result, GROW_PLOT)
    before = 0.0
    for what, at in result.phases:
        print(f"  {what:<56} {at - before:7.1f} s", flush=True)
        before = at
    say(f"the elastic job's starts: {', '.join(result.starts)}")
    say(f"final parameters {result.elastic_sha[:16]}..., 1-process reference {result.reference_sha[:16]}...")
    say(f"elastic job's final parameters identical to the uninterrupted 1-process run: {result.identical}")
    say(f"wrote {GROW_REPORT.resolve()} and {GROW_PLOT.resolve()}")
    return result.identical


@click.command()
@click.option("--act", type=click.Choice(["1", "2", "all"]), default="all", show_default=True, help="which act to run")
def main(act: str) -> None:
    env = read_environment()
    root = env.gpfs_root / "demo"
    root.mkdir(parents=True, exist_ok=True)
    held = True
    acts = [("1", "demo act 1 (Tiresias preemption)", act1), ("2", "demo act 2 (EasyScale grow/shrink)", act2)]
    for number, name, run in acts:
        if act not in (number, "all"):
            continue
        began = time.monotonic()
        try:
            ok = run(root)
        except ScenarioError as exc:
            print(f"demo: act {number}: {exc}", file=sys.stderr)
            sys.exit(1)
        timing(name, time.monotonic() - began)
        if not ok:
            print(f"demo: act {number}: the story did not hold (see above)", file=sys.stderr)
        held = held and ok
    sys.exit(0 if held else 1)


if __name__ == "__main__":
    main()
