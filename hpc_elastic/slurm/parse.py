"""Parsers of Slurm's output: pure functions from text to :mod:`hpc_elastic.slurm.types`.

Formats understood
------------------
- ``squeue --json``, ``sinfo --json``, ``sacct --json``: the OpenAPI data format (v0.0.38 in Slurm 22.05,
  v0.0.39-v0.0.42 in 23.02-25.x). Fields relied on, and how later versions changed them:

  ========================  ==========================  ================================================
  squeue job field          22.05                       later versions
  ========================  ==========================  ================================================
  job_state                 "RUNNING"                   ["RUNNING", ...] (list of base state + flags)
  *_time, priority          int                         {"set": bool, "infinite": bool, "number": int}
  time_limit (minutes)      int or null (no limit)      {"set", "infinite", "number"}
  exit_code                 int (wait status)           {"status": [...], "return_code": {...}, ...}
  memory_per_node/_cpu      int or null                 {"set", "infinite", "number"}
  tres_alloc_str/_req_str   "cpu=1,...,gres/gpu:a100=2" unchanged
  ========================  ==========================  ================================================

  sinfo nodes: ``name``, ``state`` (lower-case string; a list later), ``state_flags``, ``cpus``,
  ``alloc_cpus``, ``real_memory``, ``alloc_memory``, ``gres``, ``gres_used``, ``partitions``,
  ``active_features`` (string; a list later), ``reason`` (a string; an object with ``description`` later).
  sacct jobs: ``job_id``, ``state.current`` (string; a list later), ``state.reason``, ``time.{submission,
  eligible,start,end,elapsed,limit}``, ``tres.{allocated,requested}`` (lists of ``{type, name, count}``),
  ``required.{CPUs,memory}``, ``array``, ``het``, ``exit_code``, ``comment.job``.
  Slurm 22.05's ``squeue --json`` ignores ``-j``/``-u`` filters: callers filter the parsed jobs themselves.
- Text fallbacks for sites without the JSON plugins: ``squeue --noheader --format`` with the field list of
  :data:`SQUEUE_TEXT_FIELDS` separated by :data:`FIELD_SEPARATOR`, ``scontrol show node|partition --oneliner``,
  ``sacct --parsable2`` with :data:`SACCT_TEXT_FIELDS`. Times in text output are read as UTC because the
  adapter runs those commands with ``TZ=UTC SLURM_TIME_FORMAT=standard`` (ISO 8601 in UTC).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, TypeVar

from hpc_elastic.files import loads_json
from hpc_elastic.slurm.errors import SlurmParseError
from hpc_elastic.slurm.types import GpuCounts, Job, JobState, Node, NodeState, Partition, PartitionState, Step

# Slurm's NO_VAL / INFINITE sentinels (32 and 64 bit) mean "unset" / "unlimited".
T = TypeVar("T")
#: Slurm's integers are at most 64-bit; anything larger is not one of its numbers
_INT_LIMIT = (1 << 64) - 1
_SENTINELS = frozenset({0xFFFFFFFE, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFE, 0xFFFFFFFFFFFFFFFF, 0xFFFE, 0xFFFF})
FIELD_SEPARATOR = "\x1f"

# ``squeue --format`` codes for the text fallback, in order; free text (name, comment) last but one.
SQUEUE_TEXT_FIELDS: tuple[tuple[str, str], ...] = (
    ("job_id", "%A"),
    ("array_job_id", "%F"),
    ("array_task_id", "%K"),
    ("user", "%u"),
    ("state", "%T"),
    ("partition", "%P"),
    ("account", "%a"),
    ("submit_time", "%V"),
    ("start_time", "%S"),
    ("end_time", "%e"),
    ("time_limit", "%l"),
    ("nodes", "%N"),
    ("node_count", "%D"),
    ("tres", "%b"),
    ("cpus", "%C"),
    ("memory", "%m"),
    ("priority", "%Q"),
    ("reason", "%r"),
    ("name", "%j"),
    ("comment", "%k"),
)

SACCT_TEXT_FIELDS: tuple[str, ...] = (
    "JobIDRaw",
    "JobID",
    "JobName",
    "User",
    "State",
    "Partition",
    "Account",
    "Submit",
    "Eligible",
    "Start",
    "End",
    "TimelimitRaw",
    "NodeList",
    "NNodes",
    "AllocTRES",
    "ReqTRES",
    "AllocCPUS",
    "Priority",
    "ExitCode",
    "Reason",
    "ElapsedRaw",
    "ReqMem",
    "Comment",
)
#: the fields of :data:`SACCT_TEXT_FIELDS` a user writes: sacct prints them as they are, a ``|`` or a newline
#: included, so a name can forge the fields after it or a whole record; a reader that needs neither (the
#: scheduler daemon's job sizes) leaves them out
SACCT_USER_TEXT: frozenset[str] = frozenset({"JobName", "Comment"})


def sacct_text_fields(*, user_text: bool = True) -> tuple[str, ...]:
    """The fields of ``sacct --parsable2`` this module reads, with or without those a user writes."""
    return SACCT_TEXT_FIELDS if user_text else tuple(f for f in SACCT_TEXT_FIELDS if f not in SACCT_USER_TEXT)


# --------------------------------------------------------------------------------------------- scalars


def number(value: Any) -> int | None:
    """An integer from Slurm JSON: a plain number, or ``{"set", "infinite", "number"}``; None when unset."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, Mapping):
        if value.get("infinite") or value.get("set") is False:
            return None
        return number(value.get("number"))
    if isinstance(value, str):
        text = value.strip()
        if not text or text.upper() in {"N/A", "(NULL)", "UNLIMITED", "INFINITE", "NONE"}:
            return None
        try:
            value = float(text) if any(c in text for c in ".eEnN") else int(text)
        except ValueError:
            return None
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SlurmParseError(f"not a finite number: {value!r}")
        value = int(value)
    if not isinstance(value, int):
        return None
    if value in _SENTINELS:
        return None
    if not -_INT_LIMIT <= value <= _INT_LIMIT:
        raise SlurmParseError(f"number out of range: {value!r}")
    return value


FAR_FUTURE = datetime.max.replace(tzinfo=UTC)
"""A time past Python's last year (9999): Slurm takes ``sbatch --begin=now+3000000days``, and its squeue gives that
job's eligible, start and end times as epoch seconds beyond it; sacct prints such a year with five digits (and cuts
the seconds to one digit). Read as this instant, so one user's job cannot fail the parse of everyone's queue."""

_FIVE_DIGIT_YEAR = re.compile(r"\s*\d{5,}-\d{2}-\d{2}T[\d:]*\s*")


def epoch(value: Any) -> datetime | None:
    """A UTC datetime from epoch seconds or ISO 8601 text in UTC (0, sentinels, ``N/A``, ``Unknown`` mean unset;
    a time past year 9999 is :data:`FAR_FUTURE`)."""
    try:
        if isinstance(value, str) and re.fullmatch(r"\s*\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\s*", value):
            return datetime.fromisoformat(value.strip()).replace(tzinfo=UTC)
        if isinstance(value, str) and _FIVE_DIGIT_YEAR.fullmatch(value):
            return FAR_FUTURE
        seconds = number(value)
        if seconds is None or seconds <= 0:
            return None
        if seconds >= FAR_FUTURE.timestamp():
            return FAR_FUTURE
        return datetime.fromtimestamp(seconds, tz=UTC)
    except (ValueError, OverflowError, OSError):
        raise SlurmParseError(f"not a date: {value!r}") from None


def text_of(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, Mapping):  # e.g. {"description": ...} in newer versions
        return text_of(value.get("description") or value.get("job") or "")
    if isinstance(value, list):
        return ",".join(text_of(v) for v in value)
    return str(value)


def state_words(value: Any) -> list[str]:
    if isinstance(value, list):
        return [str(v) for v in value]
    if isinstance(value, Mapping):
        return state_words(value.get("current"))
    return str(value or "").replace("+", " ").split()


def job_state(value: Any) -> JobState:
    """The base state from ``"RUNNING"``, ``["PENDING", "REQUEUED"]`` or ``"CANCELLED by 0"``."""
    words = state_words(value)
    for word in words:
        state = JobState.parse(word)
        if state is not JobState.UNKNOWN and state not in (JobState.REQUEUED, JobState.COMPLETING):
            return state
    return JobState.parse(words[0]) if words else JobState.UNKNOWN


def memory_mb(text: str) -> int | None:
    """``256M``, ``16G``, ``1T``, ``4000`` (MB), ``256Mn``/``256Mc`` (per node/cpu) → megabytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)([KMGTP]?)[nc]?\s*", text, flags=re.IGNORECASE)
    if not match:
        return None
    scale = {"": 1.0, "K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0**2, "P": 1024.0**3}
    return int(float(match.group(1)) * scale[match.group(2).upper()])


# ------------------------------------------------------------------------------------------- hostlists


def expand_hostlist(text: str) -> tuple[str, ...]:
    """``node[1-3,7],gpu01`` → ``("node1", "node2", "node3", "node7", "gpu01")`` (zero padding kept)."""
    text = text.strip()
    if not text or text in {"(null)", "None assigned", "N/A"}:
        return ()
    names: list[str] = []
    for part in _split_top_level(text):
        names.extend(_expand_one(part))
    return tuple(names)


def _split_top_level(text: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise SlurmParseError(f"unbalanced brackets in host list {text!r}")
    parts.append("".join(current))
    return [p for p in parts if p]


def _expand_one(part: str) -> list[str]:
    match = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", part)
    if not match:
        return [part]
    prefix, ranges, rest = match.groups()
    out: list[str] = []
    for item in ranges.split(","):
        if "-" in item:
            lo, hi = item.split("-", 1)
            width = len(lo) if lo.startswith("0") else 0
            if not (lo.isdigit() and hi.isdigit()):
                raise SlurmParseError(f"bad range {item!r} in host list {part!r}")
            out.extend(f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
        else:
            out.append(prefix + item)
    return [name for head in out for name in _expand_one(head + rest)] if "[" in rest else [o + rest for o in out]


def compress_hostlist(names: Iterable[str]) -> str:
    """The inverse of :func:`expand_hostlist` for ``prefix<number>`` names: ``node[1-3,7]``."""
    groups: dict[tuple[str, int], list[int]] = {}
    plain: list[str] = []
    for name in names:
        match = re.fullmatch(r"(.*?)(\d+)", name)
        if not match:
            plain.append(name)
            continue
        prefix, digits = match.groups()
        width = len(digits) if digits.startswith("0") else 0
        groups.setdefault((prefix, width), []).append(int(digits))
    parts = list(dict.fromkeys(plain))
    for (prefix, width), numbers in groups.items():
        values = sorted(set(numbers))
        ranges: list[str] = []
        start = prev = values[0]
        for value in [*values[1:], None]:
            if value is not None and value == prev + 1:
                prev = value
                continue
            ranges.append(f"{start:0{width}d}" if start == prev else f"{start:0{width}d}-{prev:0{width}d}")
            if value is not None:
                start = prev = value
        parts.append(f"{prefix}{ranges[0]}" if len(values) == 1 else f"{prefix}[{','.join(ranges)}]")
    return ",".join(parts)


# ------------------------------------------------------------------------------------------- TRES/GRES


def parse_tres(text: str) -> dict[str, str]:
    """``cpu=1,mem=256M,gres/gpu:a100=2`` → ``{"cpu": "1", "mem": "256M", "gres/gpu:a100": "2"}``."""
    out: dict[str, str] = {}
    for item in text.split(","):
        if "=" in item:
            key, value = item.split("=", 1)
            out[key.strip()] = value.strip()
    return out


def gpus_from_tres(tres: Mapping[str, str]) -> GpuCounts:
    """GPUs by type from a TRES mapping; untyped GPUs beyond the typed ones count under ``""``."""
    typed: dict[str, int] = {}
    untyped = 0
    for key, value in tres.items():
        count = number(value) or 0
        if key == "gres/gpu":
            untyped = count
        elif key.startswith("gres/gpu:"):
            typed[key.split(":", 1)[1]] = typed.get(key.split(":", 1)[1], 0) + count
    rest = untyped - sum(typed.values())
    if rest > 0:
        typed[""] = rest
    return GpuCounts.of(typed)


def gpus_from_gres(text: str) -> GpuCounts:
    """Node or job GRES: ``gpu:a100:4``, ``gpu:a100:2(IDX:0-1)``, ``gres:gpu:2``, ``gpu:4(S:0)``,
    several separated by commas; ``(null)`` is none."""
    counts: dict[str, int] = {}
    cleaned = re.sub(r"\([^)]*\)", "", text or "")
    for item in cleaned.split(","):
        fields = [f for f in item.strip().split(":") if f]
        if fields and fields[0] in {"gres", "gres/gpu"}:
            fields = fields[1:] if fields[0] == "gres" else ["gpu", *fields[1:]]
        if not fields or fields[0].split("/")[-1] != "gpu":
            continue
        if len(fields) == 3 and fields[2].isdigit():
            counts[fields[1]] = counts.get(fields[1], 0) + int(fields[2])
        elif len(fields) == 2 and fields[1].isdigit():
            counts[""] = counts.get("", 0) + int(fields[1])
        elif len(fields) == 2:
            counts[fields[1]] = counts.get(fields[1], 0) + 1
        elif len(fields) == 1:
            counts[""] = counts.get("", 0) + 1
    return GpuCounts.of(counts)


def _exit_code(value: Any) -> tuple[int | None, int | None]:
    """(return code, signal) from an int wait status, ``"0:0"`` text, or a newer-version object."""
    if value is None:
        return None, None
    if isinstance(value, Mapping):
        code = number(value.get("return_code"))
        signal_field = value.get("signal")
        signal = number(signal_field.get("id") if isinstance(signal_field, Mapping) else signal_field)
        return code, signal
    if isinstance(value, str) and ":" in value:
        code_text, signal_text = value.split(":", 1)
        return number(code_text), number(signal_text)
    status = number(value)
    if status is None:
        return None, None
    return (status >> 8) & 0xFF, (status & 0x7F) or None


# ------------------------------------------------------------------------------------------------ JSON


def load_json(text: str, what: str) -> dict[str, Any]:
    try:
        data = loads_json(text, f"{what}: output")
    except ValueError as exc:
        raise SlurmParseError(str(exc)) from None
    if not isinstance(data, dict):
        raise SlurmParseError(f"{what}: expected a JSON object, got {type(data).__name__}")
    return data


def _records(data: Mapping[str, Any], key: str, what: str) -> list[Mapping[str, Any]]:
    items = data.get(key) or []
    if not isinstance(items, list) or not all(isinstance(item, Mapping) for item in items):
        raise SlurmParseError(f"{what}: {key!r} is not a list of objects")
    return items


def _each(records: list[Mapping[str, Any]], parse: Callable[[Mapping[str, Any]], T], what: str) -> list[T]:
    """``parse`` of every record; any malformed field (a wrong type, a value out of range) is a
    :class:`SlurmParseError` naming the record, never another exception."""
    out = []
    for index, raw in enumerate(records):
        try:
            out.append(parse(raw))
        except SlurmParseError as exc:
            raise SlurmParseError(f"{what}: record {index} ({_record_id(raw)}): {exc}") from None
        except (TypeError, ValueError, AttributeError, KeyError, OverflowError, IndexError) as exc:
            raise SlurmParseError(f"{what}: record {index} ({_record_id(raw)}): bad field: {exc}") from None
    return out


def _record_id(raw: Mapping[str, Any]) -> str:
    for key in ("job_id", "name"):
        if isinstance(raw.get(key), int | str):
            return f"{key} {str(raw[key])[:40]}"
    return "unnamed"


def parse_squeue_json(text: str) -> list[Job]:
    data = load_json(text, "squeue --json")
    return _each(_records(data, "jobs", "squeue --json"), parse_squeue_json_record, "squeue --json")


def parse_squeue_json_record(raw: Mapping[str, Any]) -> Job:
    """One job object of ``squeue --json``."""
    state = job_state(raw.get("job_state"))
    tres_text = text_of(raw.get("tres_alloc_str")) if state.is_running else ""
    tres = parse_tres(tres_text or text_of(raw.get("tres_req_str")))
    gpus = gpus_from_tres(tres)
    if not gpus.total:
        per_node = gpus_from_gres(text_of(raw.get("tres_per_node")))
        nodes = max(1, number(raw.get("node_count")) or 1)
        gpus = (
            GpuCounts.of({k: v * nodes for k, v in per_node.by_type})
            if per_node.total
            else gpus_from_gres(text_of(raw.get("tres_per_job")))
        )
    cpus = number(raw.get("cpus")) or 0
    memory = number(raw.get("memory_per_node"))
    node_count = number(raw.get("node_count")) or 0
    if memory is not None:
        memory *= max(1, node_count)
    else:
        per_cpu = number(raw.get("memory_per_cpu"))
        memory = per_cpu * cpus if per_cpu is not None else memory_mb(tres.get("mem", ""))
    limit = number(raw.get("time_limit"))
    code, signal = _exit_code(raw.get("exit_code"))
    started = state.is_running or not state.is_active
    return Job(
        job_id=_required_int(raw.get("job_id"), "job_id"),
        name=text_of(raw.get("name")),
        user=text_of(raw.get("user_name")),
        state=state,
        user_id=number(raw.get("user_id")),
        partition=text_of(raw.get("partition")),
        account=text_of(raw.get("account")),
        array_job_id=number(raw.get("array_job_id")) or None,
        array_task_id=number(raw.get("array_task_id")),
        het_job_id=number(raw.get("het_job_id")) or None,
        het_job_offset=number(raw.get("het_job_offset")) if number(raw.get("het_job_id")) else None,
        submit_time=epoch(raw.get("submit_time")),
        eligible_time=epoch(raw.get("eligible_time")),
        start_time=epoch(raw.get("start_time")) if started else None,
        end_time=epoch(raw.get("end_time")) if not state.is_active else None,
        time_limit_s=limit * 60 if limit is not None else None,
        nodes=expand_hostlist(text_of(raw.get("nodes"))) if started else (),
        node_count=node_count,
        gpus=gpus,
        cpus=cpus,
        tasks=number(raw.get("tasks")) or None,
        memory_mb=memory,
        priority=number(raw.get("priority")),
        comment=text_of(raw.get("comment")),
        admin_comment=text_of(raw.get("admin_comment")),
        restart_count=number(raw.get("restart_cnt")) or 0,
        exit_code=code if not state.is_active else None,
        signal=signal if not state.is_active else None,
        pending_reason=_reason(raw.get("state_reason")) if state.is_pending else "",
        requeue=raw.get("requeue") if isinstance(raw.get("requeue"), bool) else None,
        preempt_time=epoch(raw.get("preempt_time")) if started else None,
    )


def _reason(value: Any) -> str:
    text = text_of(value)
    return "" if text == "None" else text


def _required_int(value: Any, what: str) -> int:
    result = number(value)
    if result is None:
        raise SlurmParseError(f"missing or bad {what}: {value!r}")
    return result


def parse_sinfo_json(text: str) -> list[Node]:
    data = load_json(text, "sinfo --json")
    nodes: dict[str, Node] = {}
    for seen in _each(_records(data, "nodes", "sinfo --json"), _node_from_sinfo, "sinfo --json"):
        old = nodes.get(seen.name)  # later versions list a node once per partition
        parts = tuple(dict.fromkeys(old.partitions + seen.partitions)) if old is not None else seen.partitions
        nodes[seen.name] = replace(seen, partitions=parts)
    return sorted(nodes.values(), key=_natural_key)


def _natural_key(node: Node) -> tuple[str, int]:
    match = re.fullmatch(r"(.*?)(\d*)", node.name)
    prefix, digits = match.groups() if match else (node.name, "")
    return prefix, int(digits) if digits else -1


def _node_from_sinfo(raw: Mapping[str, Any]) -> Node:
    words = [w.upper() for w in state_words(raw.get("state"))]
    flags = [str(f).upper() for f in raw.get("state_flags") or []]
    base = NodeState.parse(words[0]) if words else NodeState.UNKNOWN
    flags.extend(w for w in words[1:] if w not in flags)
    features = raw.get("active_features") or raw.get("features") or ""
    feature_list = features if isinstance(features, list) else str(features).split(",")
    partitions = raw.get("partitions") or []
    return Node(
        name=_text_required(raw.get("name"), "node name"),
        state=base,
        flags=tuple(flags),
        cpus=number(raw.get("cpus")) or 0,
        cpus_allocated=number(raw.get("alloc_cpus")) or 0,
        memory_mb=number(raw.get("real_memory")) or 0,
        memory_allocated_mb=number(raw.get("alloc_memory")) or 0,
        gpus=gpus_from_gres(text_of(raw.get("gres"))),
        gpus_allocated=gpus_from_gres(text_of(raw.get("gres_used"))),
        partitions=tuple(str(p) for p in (partitions if isinstance(partitions, list) else [partitions])),
        features=tuple(f.strip() for f in feature_list if str(f).strip()),
        reason=text_of(raw.get("reason")),
    )


def _text_required(value: Any, what: str) -> str:
    text = text_of(value)
    if not text:
        raise SlurmParseError(f"missing {what}")
    return text


def parse_sacct_json(text: str) -> list[Job]:
    data = load_json(text, "sacct --json")
    return _each(_records(data, "jobs", "sacct --json"), _job_from_sacct, "sacct --json")


def _tres_list(items: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        kind, name, count = item.get("type"), item.get("name"), item.get("count")
        if count is None:
            continue
        key = f"{kind}/{name}" if name else str(kind)
        out[key] = str(count)
    return out


def _job_from_sacct(raw: Mapping[str, Any]) -> Job:
    times = raw.get("time") or {}
    state_raw = raw.get("state") or {}
    state = job_state(state_raw.get("current") if isinstance(state_raw, Mapping) else state_raw)
    tres = raw.get("tres") or {}
    allocated = _tres_list(tres.get("allocated"))
    gpus = gpus_from_tres(allocated or _tres_list(tres.get("requested")))
    required = raw.get("required") or {}
    array = raw.get("array") or {}
    het = raw.get("het") or {}
    limit = number(times.get("limit"))
    code, signal = _exit_code(raw.get("exit_code"))
    comment = raw.get("comment")
    return Job(
        job_id=_required_int(raw.get("job_id"), "job_id"),
        name=text_of(raw.get("name")),
        user=text_of(raw.get("user")),
        state=state,
        partition=text_of(raw.get("partition")),
        account=text_of(raw.get("account")),
        array_job_id=number(array.get("job_id")) or None,
        array_task_id=number(array.get("task_id")),
        het_job_id=number(het.get("job_id")) or None,
        het_job_offset=number(het.get("job_offset")),
        submit_time=epoch(times.get("submission")),
        eligible_time=epoch(times.get("eligible")),
        start_time=epoch(times.get("start")),
        end_time=epoch(times.get("end")),
        time_limit_s=limit * 60 if limit is not None else None,
        nodes=expand_hostlist(text_of(raw.get("nodes"))),
        node_count=number(raw.get("allocation_nodes")) or 0,
        gpus=gpus,
        cpus=number(allocated.get("cpu")) or number(required.get("CPUs")) or 0,
        memory_mb=number(allocated.get("mem")) or number(required.get("memory")),
        priority=number(raw.get("priority")),
        comment=text_of(comment.get("job") if isinstance(comment, Mapping) else comment),
        exit_code=code,
        signal=signal,
        pending_reason=_reason(state_raw.get("reason")) if isinstance(state_raw, Mapping) else "",
        elapsed_s=number(times.get("elapsed")),
    )


# ------------------------------------------------------------------------------------------------ text


def _rows(
    text: str, count: int, what: str, *, separator: str = "|", free_last: bool = False
) -> Iterator[tuple[int, list[str]]]:
    """The non-blank lines of a delimited text output with their numbers, each split into ``count`` fields
    (``free_last``: the last field is free text that may hold the separator); :class:`SlurmParseError` naming
    the line otherwise."""
    for line_number, line in enumerate(text.split("\n"), start=1):  # not splitlines: \x1c-\x1e, \x85, \u2028 ...
        if not line.strip():
            continue
        values = line.split(separator, count - 1) if free_last else line.split(separator)
        if len(values) != count:
            raise SlurmParseError(f"{what} line {line_number}: expected {count} fields, got {len(values)}")
        yield line_number, values


#: ``sacct --format`` of :func:`parse_sacct_steps` (text: 22.05's ``--json`` reports a failed step's exit code as 0)
SACCT_STEP_FIELDS: tuple[str, ...] = ("JobID", "JobName", "State", "ExitCode", "MaxRSS", "AllocTRES")


def parse_sacct_steps(text: str) -> list[Step]:
    """The steps in ``sacct --parsable2 --noheader --format=<SACCT_STEP_FIELDS> --jobs=ID`` (the job's own line,
    ``JobID`` without a dot, skipped): ``MaxRSS`` such as ``423076K``, the step's memory from ``AllocTRES``."""
    steps: list[Step] = []
    for line_number, values in _rows(text, len(SACCT_STEP_FIELDS), "sacct"):
        job_text, name, state, exit_code, max_rss, alloc = values
        job, dot, step_id = job_text.partition(".")
        if not dot:
            continue
        job_id = number(job.partition("+")[0])
        if job_id is None or not step_id:
            raise SlurmParseError(f"sacct line {line_number}: bad step id {job_text!r}")
        code, signal = _exit_code(exit_code)
        mem = parse_tres(alloc).get("mem")
        steps.append(
            Step(
                job_id=job_id,
                step_id=step_id,
                name=name,
                state=job_state(state),
                exit_code=code,
                signal=signal or None,
                mem_mb=memory_mb(mem) if mem else None,
                max_rss_mb=size_mib(max_rss),
            )
        )
    return steps


#: ``sacct --format`` of :func:`parse_sacct_step_times` (the step name last: free text)
SACCT_STEP_TIME_FIELDS: tuple[str, ...] = ("JobIDRaw", "State", "Start", "End", "AllocCPUS", "JobName")


def parse_sacct_step_times(text: str) -> list[Step]:
    """The steps, with their start, end and cores, in ``sacct --parsable2 --noheader --format=<SACCT_STEP_TIME_FIELDS>``
    over a time window (jobs' own lines, ``JobIDRaw`` without a dot, skipped): ``Unknown`` or ``None`` for a step
    not started or still running is None."""
    steps: list[Step] = []
    for line_number, values in _rows(text, len(SACCT_STEP_TIME_FIELDS), "sacct", free_last=True):
        job_text, state, start, end, cpus, name = values
        job, dot, step_id = job_text.partition(".")
        if not dot:
            continue
        if not job.isdigit() or not step_id:
            raise SlurmParseError(f"sacct line {line_number}: bad step id {job_text!r}")
        steps.append(
            Step(
                job_id=int(job),
                step_id=step_id,
                name=name,
                state=job_state(state),
                start_time=epoch(start),
                end_time=epoch(end),
                cpus=number(cpus),
            )
        )
    return steps


def size_mib(text: str) -> float | None:
    """``423076K``, ``12M``, ``1.5G`` or a number of bytes → MiB (None when empty or not a size)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)([KMGTP]?)\s*", text, flags=re.IGNORECASE)
    if not match:
        return None
    scale = {"": 2.0**-20, "K": 2.0**-10, "M": 1.0, "G": 2.0**10, "T": 2.0**20, "P": 2.0**30}
    return float(match.group(1)) * scale[match.group(2).upper()]


def parse_key_values(line: str) -> dict[str, str]:
    """One ``scontrol show ... --oneliner`` record: ``Key=Value`` pairs; values may contain spaces."""
    out: dict[str, str] = {}
    for match in re.finditer(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_:/]*)=(.*?)(?=\s+[A-Za-z_][A-Za-z0-9_:/]*=|\s*$)", line):
        out[match.group(1)] = match.group(2).strip()
    return out


def parse_scontrol_nodes(text: str) -> list[Node]:
    nodes = []
    for line in text.splitlines():
        if not line.strip().startswith("NodeName="):
            continue
        kv = parse_key_values(line.strip())
        words = kv.get("State", "UNKNOWN").upper().split("+")
        cfg = parse_tres(kv.get("CfgTRES", ""))
        alloc = parse_tres(kv.get("AllocTRES", ""))
        nodes.append(
            Node(
                name=kv["NodeName"],
                state=NodeState.parse(words[0]),
                flags=tuple(words[1:]),
                cpus=number(kv.get("CPUTot")) or 0,
                cpus_allocated=number(kv.get("CPUAlloc")) or 0,
                memory_mb=number(kv.get("RealMemory")) or 0,
                memory_allocated_mb=number(kv.get("AllocMem")) or 0,
                gpus=gpus_from_tres(cfg) if cfg else gpus_from_gres(kv.get("Gres", "")),
                gpus_allocated=gpus_from_tres(alloc) if alloc else gpus_from_gres(kv.get("GresUsed", "")),
                partitions=tuple(p for p in kv.get("Partitions", "").split(",") if p),
                features=tuple(f for f in kv.get("ActiveFeatures", "").split(",") if f and f != "(null)"),
                reason=kv.get("Reason", ""),
            )
        )
    return sorted(nodes, key=_natural_key)


def duration_s(text: str) -> int | None:
    """Slurm durations: ``UNLIMITED``, ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM[:SS]``."""
    text = text.strip()
    if not text or text.upper() in {"UNLIMITED", "INFINITE", "NOT_SET", "N/A", "NONE"}:
        return None
    days = 0
    if "-" in text:
        day_text, text = text.split("-", 1)
        days = int(day_text)
        parts = [int(p) for p in text.split(":")]
        parts += [0] * (3 - len(parts))
        hours, minutes, seconds = parts
    else:
        parts = [int(p) for p in text.split(":")]
        if len(parts) == 1:
            hours, minutes, seconds = 0, parts[0], 0
        elif len(parts) == 2:
            hours, (minutes, seconds) = 0, parts
        else:
            hours, minutes, seconds = parts
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def parse_scontrol_partitions(text: str) -> list[Partition]:
    partitions = []
    for line in text.splitlines():
        if not line.strip().startswith("PartitionName="):
            continue
        kv = parse_key_values(line.strip())
        try:
            max_time = duration_s(kv.get("MaxTime", ""))
        except ValueError as exc:
            raise SlurmParseError(f"bad MaxTime {kv.get('MaxTime')!r} of partition {kv['PartitionName']}") from exc
        partitions.append(
            Partition(
                name=kv["PartitionName"],
                state=PartitionState.parse(kv.get("State", "UNKNOWN")),
                nodes=expand_hostlist(kv.get("Nodes", "")),
                default=kv.get("Default", "NO").upper() == "YES",
                max_time_s=max_time,
                priority_tier=number(kv.get("PriorityTier")) or 1,
                preempt_mode=kv.get("PreemptMode", ""),
                total_cpus=number(kv.get("TotalCPUs")) or 0,
            )
        )
    return partitions


def parse_squeue_text(text: str) -> list[Job]:
    """Jobs from ``squeue --noheader --format=<SQUEUE_TEXT_FIELDS joined by FIELD_SEPARATOR>``."""
    names = [name for name, _ in SQUEUE_TEXT_FIELDS]
    jobs = []
    for _, values in _rows(text, len(names), "squeue", separator=FIELD_SEPARATOR):
        row = dict(zip(names, values, strict=True))
        state = job_state(row["state"])
        limit = duration_s(row["time_limit"]) if row["time_limit"] else None
        node_count = number(row["node_count"]) or 0
        per_node = gpus_from_gres(row["tres"])
        started = state.is_running or not state.is_active
        jobs.append(
            Job(
                job_id=_required_int(row["job_id"], "job_id"),
                name=row["name"],
                user=row["user"],
                state=state,
                partition=row["partition"],
                account=row["account"],
                array_job_id=number(row["array_job_id"]) if number(row["array_task_id"]) is not None else None,
                array_task_id=number(row["array_task_id"]),
                submit_time=epoch(row["submit_time"]),
                start_time=epoch(row["start_time"]) if started else None,
                end_time=epoch(row["end_time"]) if not state.is_active else None,
                time_limit_s=limit,
                nodes=expand_hostlist(row["nodes"]) if started else (),
                node_count=node_count,
                gpus=GpuCounts.of({k: v * max(1, node_count) for k, v in per_node.by_type}),
                cpus=number(row["cpus"]) or 0,
                memory_mb=memory_mb(row["memory"]),
                priority=number(row["priority"]),
                comment=row["comment"] if row["comment"] != "(null)" else "",
                pending_reason=_reason(row["reason"]) if state.is_pending else "",
            )
        )
    return jobs


def parse_sacct_text(text: str, *, user_text: bool = True) -> list[Job]:
    """Jobs from ``sacct --parsable2 --noheader --format=<sacct_text_fields(user_text=...)>`` (comment last: may
    hold ``|``); without ``user_text`` their names and comments are empty."""
    fields = sacct_text_fields(user_text=user_text)
    jobs = []
    for _, values in _rows(text, len(fields), "sacct", free_last=user_text):
        row = {"JobName": "", "Comment": "", **dict(zip(fields, values, strict=True))}
        if not row["JobIDRaw"].isdigit():  # job steps: 12.batch, 12.0
            continue
        alloc = parse_tres(row["AllocTRES"])
        limit = number(row["TimelimitRaw"])
        code, signal = _exit_code(row["ExitCode"])
        array_match = re.fullmatch(r"(\d+)_(\d+)", row["JobID"])
        jobs.append(
            Job(
                job_id=int(row["JobIDRaw"]),
                name=row["JobName"],
                user=row["User"],
                state=job_state(row["State"]),
                partition=row["Partition"],
                account=row["Account"],
                array_job_id=int(array_match.group(1)) if array_match else None,
                array_task_id=int(array_match.group(2)) if array_match else None,
                submit_time=epoch(row["Submit"]),
                eligible_time=epoch(row["Eligible"]),
                start_time=epoch(row["Start"]),
                end_time=epoch(row["End"]),
                time_limit_s=limit * 60 if limit is not None else None,
                nodes=expand_hostlist(row["NodeList"]),
                node_count=number(row["NNodes"]) or 0,
                gpus=gpus_from_tres(alloc or parse_tres(row["ReqTRES"])),
                cpus=number(row["AllocCPUS"]) or 0,
                memory_mb=memory_mb(alloc.get("mem", "")) or memory_mb(row["ReqMem"]),
                priority=number(row["Priority"]),
                comment=row["Comment"],
                exit_code=code,
                signal=signal,
                pending_reason=_reason(row["Reason"]),
                elapsed_s=number(row["ElapsedRaw"]),
            )
        )
    return jobs


def parse_sbatch_parsable(text: str) -> int:
    """``sbatch --parsable`` prints ``<jobid>`` or ``<jobid>;<cluster>``."""
    for line in text.splitlines():
        head = line.strip().split(";", 1)[0]
        if head.isdigit():
            return int(head)
    raise SlurmParseError(f"sbatch --parsable printed no job id: {text.strip()[:200]!r}")


def parse_sacctmgr_accounts(text: str) -> frozenset[str]:
    """``sacctmgr --parsable2 --noheader show account format=Account`` → the account names (lower case, as Slurm
    keeps them)."""
    return frozenset(line.strip().rstrip("|").lower() for line in text.splitlines() if line.strip().rstrip("|"))


def parse_sprio_site_factors(text: str) -> dict[int, int]:
    """``sprio --noheader --format=%i|%S`` → {job id: site factor}."""
    out: dict[int, int] = {}
    for line in text.splitlines():
        fields: Sequence[str] = line.strip().split("|")
        if len(fields) == 2 and fields[0].strip().isdigit():
            value = number(fields[1])
            if value is not None:
                out[int(fields[0])] = value
    return out
