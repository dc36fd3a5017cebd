"""DL² against the slot baselines: average JCT on held-in and other-shape traces, training wall time, and the
inference time of one scheduling pass at 1,000 jobs.

One run: train a model (supervised bootstrap from DRF, or from the Optimus-like policy with ``--teacher optimus``,
then online actor-critic; :mod:`hpc_elastic.dl2.train`) or load one with ``--model``, then run DL² (greedy) and
every slot baseline the registry has (drf, optimus, tiresias-las, tiresias-las+elastic) on:

- held-in traces: the training's generator setting (diurnal, the training load, 200 jobs), seeds the training
  never saw;
- traces of other shapes: Poisson arrivals at load 4 with §6.4's speed variation 0.3 (300 jobs), a batch of 150
  jobs at slot 0, and Pollux workload-1 converted to PS jobs (``from_gpu_trace``; skipped when the shared traces
  are absent).

Average JCT in slots (an unfinished job counts to the end of the run; every run is cut after 4x DRF's slots);
ratios JCT(baseline) / JCT(dl2) (> 1: DL² is better) against DRF and tiresias-las. Inference: one
``Dl2Policy.allocate`` (the greedy loop in C, batches of J jobs) on a slot of 1,000 waiting jobs, on the model's
cluster and on a 250-server cluster (1,000 GPUs), median of repeats, next to the same loop in Python (``infer``,
the loop's definition; its decision must be the same) and DRF's ``allocate`` on the same slot.
Goals (to compare with, not tuned to): JCT >= 1.4x better than DRF (DL² reports -44.1 %), better than
tiresias-las, inference <= 10 ms per pass. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from hpc_elastic.dl2 import model_file
from hpc_elastic.dl2.net import inference_network
from hpc_elastic.dl2.train import BOOTSTRAP_TEACHERS, TrainConfig, compare, save_model, train
from hpc_elastic.policy.dl2 import Dl2Policy, Network, StateSpec, infer
from hpc_elastic.policy.drf import Drf
from hpc_elastic.policy.slot_registry import SLOT_POLICY_NAMES, make_slot_policy
from hpc_elastic.policy.slots import Servers, SlotInput, SlotJob
from hpc_elastic.sim.ps_jobs import JOB_TYPES, SLOT_SECONDS, Arrival, SlotTraceJob, from_gpu_trace, generate
from hpc_elastic.sim.slots import SlotConfig
from hpc_elastic.sim.trace import TraceFormat, load_trace

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"


def traces(config: TrainConfig, pollux: Path) -> list[tuple[str, str, tuple[SlotTraceJob, ...]]]:
    """(name, kind, jobs): held-in first, then other shapes."""
    cluster = config.cluster
    out = [
        (
            f"diurnal load {config.load:g}, 200 jobs, seed {seed}",
            "held-in",
            generate(seed, 200, cluster, load=config.load),
        )
        for seed in (101, 102, 103)
    ]
    out.append(
        (
            "poisson load 4, variation 0.3, 300 jobs, seed 202",
            "other",
            generate(202, 300, cluster, arrival=Arrival.POISSON, load=4.0, variation=0.3),
        )
    )
    out.append(("batch of 150 jobs, seed 303", "other", generate(303, 150, cluster, arrival=Arrival.BATCH)))
    if pollux.exists():
        jobs = load_trace(pollux, TraceFormat("pollux")).jobs
        out.append((f"pollux {pollux.stem} ({len(jobs)} jobs)", "other", from_gpu_trace(jobs, seed=1, servers=cluster)))
    return out


def big_slot(servers: Servers, jobs: int = 1000) -> SlotInput:
    """A slot with ``jobs`` waiting jobs of a generated trace (nothing run yet)."""
    trace = generate(404, jobs, servers, arrival=Arrival.BATCH)
    slot_jobs = tuple(
        SlotJob(
            job.job_id,
            job.job_type,
            job.arrival,
            job.epochs_total,
            request_workers=job.request_workers,
            request_ps=job.request_ps,
            max_workers=job.max_workers,
            max_ps=job.max_ps,
        )
        for job in trace
    )
    return SlotInput(0, SLOT_SECONDS, JOB_TYPES, servers, slot_jobs)


def time_pass(network: Network, spec: StateSpec, inp: SlotInput, repeats: int) -> dict[str, float]:
    """One slot's pass, median of ``repeats``: DL²'s deployed greedy loop (C), the same loop in Python (``infer``
    with the greedy chooser, the loop's definition: the whole mask at every inference) and DRF."""
    dl2, drf = Dl2Policy(network, spec), Drf()
    timed: dict[str, Callable[[], object]] = {
        "dl2": lambda: dl2.allocate(inp),
        "python_loop": lambda: infer(spec, inp, network),
        "drf": lambda: drf.allocate(inp),
    }
    reference, steps = infer(spec, inp, network)
    out: dict[str, float] = {"inferences": float(len(steps)), "same_decision": float(dl2.allocate(inp) == reference)}
    for name, run in timed.items():
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            samples.append(time.perf_counter() - start)
        out[f"{name}_ms"] = 1e3 * statistics.median(samples)
    out["dl2_us_per_inference"] = 1e3 * out["dl2_ms"] / max(out["inferences"], 1.0)
    out["python_loop_over_dl2"] = out["python_loop_ms"] / out["dl2_ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="Evaluate this model file instead of training one.")
    parser.add_argument("--save", type=Path, help="Write the trained model here.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--teacher", choices=sorted(BOOTSTRAP_TEACHERS), default=TrainConfig.bootstrap, help="The supervised teacher."
    )
    parser.add_argument("--jobs", type=int, default=TrainConfig.jobs)
    parser.add_argument("--traces", type=int, default=TrainConfig.traces)
    parser.add_argument("--max-jobs", type=int, default=TrainConfig.max_jobs, help="J")
    parser.add_argument("--supervised-epochs", type=int, default=TrainConfig.supervised_epochs)
    parser.add_argument("--rl-episodes", type=int, default=TrainConfig.rl_episodes)
    parser.add_argument("--rl-lr", type=float, default=TrainConfig.rl_lr)
    parser.add_argument("--immediate", type=float, default=TrainConfig.immediate, help="Immediate advantage weight.")
    parser.add_argument(
        "--online-confidence",
        type=float,
        default=TrainConfig.online_confidence,
        help="The supervised policy's mean greedy probability when the online phase starts (1: untempered).",
    )
    parser.add_argument("--eval-every", type=int, default=TrainConfig.eval_every)
    parser.add_argument("--pollux", type=Path, default=TRACES / "pollux_workloads" / "workload-1.csv")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    load_before = os.getloadavg()
    summary: dict[str, object] = {"loadavg_start": [round(v, 2) for v in load_before]}
    if args.model is not None:
        loaded = model_file.load(args.model)
        config = TrainConfig.from_dict(loaded.config)
        network, spec = loaded.network(), loaded.spec
        summary["model"] = str(args.model)
        meta_sup = loaded.meta.get("supervised", {})
        summary["held_out_match"] = meta_sup.get("held_out_match")
    else:
        config = TrainConfig(
            seed=args.seed,
            bootstrap=args.teacher,
            jobs=args.jobs,
            traces=args.traces,
            max_jobs=args.max_jobs,
            supervised_epochs=args.supervised_epochs,
            rl_episodes=args.rl_episodes,
            rl_lr=args.rl_lr,
            eval_every=args.eval_every,
            immediate=args.immediate,
            online_confidence=args.online_confidence,
        )
        start = time.perf_counter()
        result = train(config, progress=lambda line: print(f"[{time.perf_counter() - start:7.1f} s] {line}"))
        wall = time.perf_counter() - start
        if args.save is not None:
            save_model(args.save, result)
        network, spec = inference_network(result.policy), result.spec
        summary.update(
            train_wall_s=round(wall, 1),
            supervised_samples=result.supervised.samples,
            train_match=round(result.supervised.train_match, 4),
            held_out_match=round(result.supervised.held_out_match, 4),
            temperature=round(result.supervised.temperature, 3),
            validation_jct_drf_slots=round(result.drf_validation_jct / SLOT_SECONDS, 3),
            validation_jct_supervised_slots=round(result.supervised_jct / SLOT_SECONDS, 3),
            validation_jct_best_slots=round(result.best.avg_jct / SLOT_SECONDS, 3),
            best_update=result.best.update,
            updates=result.curve[-1].update,
        )
        print(
            f"training: {wall:.0f} s; {config.bootstrap} match {result.supervised.train_match:.3f} (training), "
            f"{result.supervised.held_out_match:.3f} (held out); validation JCT: DRF "
            f"{result.drf_validation_jct / SLOT_SECONDS:.2f}, supervised {result.supervised_jct / SLOT_SECONDS:.2f}, "
            f"best {result.best.avg_jct / SLOT_SECONDS:.2f} slots (update {result.best.update} of "
            f"{result.curve[-1].update})"
        )
    summary["config"] = dataclasses.asdict(config)

    baselines = [make_slot_policy(name) for name in SLOT_POLICY_NAMES]
    sim = SlotConfig(config.cluster)
    rows: list[dict[str, object]] = []
    ratios: dict[str, list[tuple[float, float]]] = {"held-in": [], "other": []}
    names = ["dl2", *SLOT_POLICY_NAMES]
    print(f"\naverage JCT (slots), cluster {'x'.join(map(str, config.servers))}")
    print(f"{'trace':<48} {'kind':<8} " + " ".join(f"{n:>12}" for n in names) + "  drf/dl2  las/dl2")
    for name, kind, jobs in traces(config, args.pollux):
        jct = compare(Dl2Policy(network, spec), baselines, sim, jobs)
        slots = {k: v / SLOT_SECONDS for k, v in jct.items()}
        ratio_drf = slots["drf"] / slots["dl2"]
        ratio_las = slots["tiresias-las"] / slots["dl2"] if "tiresias-las" in slots else float("nan")
        print(
            f"{name:<48} {kind:<8} "
            + " ".join(f"{slots[n]:>12.3f}" for n in names)
            + f"  {ratio_drf:7.3f}  {ratio_las:7.3f}"
        )
        ratios[kind].append((ratio_drf, ratio_las))
        rows.append(
            {"trace": name, "kind": kind, "avg_jct_slots": slots, "drf_over_dl2": ratio_drf, "las_over_dl2": ratio_las}
        )
    summary["traces"] = rows
    for kind, pairs in ratios.items():
        if pairs:
            summary[f"mean_drf_over_dl2_{kind}"] = statistics.fmean(a for a, _ in pairs)
            summary[f"mean_las_over_dl2_{kind}"] = statistics.fmean(b for _, b in pairs)

    print("\ninference per pass, 1,000 waiting jobs (median of repeats)")
    for label, servers in (("model cluster", config.cluster), ("250x4x16", Servers.uniform(250, 4, 16))):
        timing = time_pass(network, spec, big_slot(servers), args.repeats)
        print(
            f"{label:<14} dl2 {timing['dl2_ms']:8.2f} ms ({timing['inferences']:.0f} inferences, "
            f"{timing['dl2_us_per_inference']:.1f} us each)   python loop {timing['python_loop_ms']:8.2f} ms "
            f"({timing['python_loop_over_dl2']:.1f}x)   drf {timing['drf_ms']:8.2f} ms   same decision: "
            f"{bool(timing['same_decision'])}"
        )
        summary[f"inference_{label.replace(' ', '_')}"] = timing
    summary["loadavg_end"] = [round(v, 2) for v in os.getloadavg()]
    print(f"load average: start {load_before}, end {os.getloadavg()}")
    print(json.dumps(summary, default=str))


if __name__ == "__main__":
    main()
