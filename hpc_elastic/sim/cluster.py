"""Simulated clusters: ``NxG`` (N nodes of G GPUs) or a node file.

Node file: CSV with a header. Columns ``name,gpus[,gpu_type][,switch]``; the Alibaba openb node list
(``sn,cpu_milli,memory_mib,gpu,model``) is accepted as is (``sn`` = name, ``gpu`` = GPUs, ``model`` = GPU type).
Nodes without GPUs are left out.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

from hpc_elastic.files import read_text_input
from hpc_elastic.policy.types import NodeView

#: the largest simulated cluster: 100k nodes of 64 GPUs (a 10M-node cluster takes GBs before a pass)
MAX_NODES = 100_000
MAX_GPUS_PER_NODE = 64
_SPEC = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")
_ALIASES = {
    "name": ("name", "sn", "node", "hostname"),
    "gpus": ("gpus", "gpu", "num_gpu", "num_gpus"),
    "gpu_type": ("gpu_type", "model", "type"),
    "switch": ("switch", "rack"),
}


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    gpus: int
    gpu_type: str = ""
    switch: str = ""

    def view(self, free: int | None = None) -> NodeView:
        return NodeView(self.name, self.gpus, self.gpus if free is None else free, self.gpu_type, self.switch)


def parse_cluster_spec(spec: str) -> tuple[NodeSpec, ...]:
    """``"15x4"`` -> 15 nodes of 4 GPUs (one GPU type, one switch)."""
    match = _SPEC.match(spec)
    if not match:
        raise ValueError(f"cluster must look like NODESxGPUS (e.g. 15x4), got {spec!r}")
    nodes, gpus = int(match.group(1)), int(match.group(2))
    if nodes < 1 or gpus < 1:
        raise ValueError(f"cluster needs at least one node with at least one GPU, got {spec!r}")
    if nodes > MAX_NODES or gpus > MAX_GPUS_PER_NODE:
        raise ValueError(f"cluster may have at most {MAX_NODES} nodes of {MAX_GPUS_PER_NODE} GPUs, got {spec!r}")
    width = len(str(nodes - 1))
    return tuple(NodeSpec(f"node{i:0{width}d}", gpus) for i in range(nodes))


def load_cluster_file(path: str | Path) -> tuple[NodeSpec, ...]:
    """Nodes from a CSV node file (see module doc); errors name the line."""
    file = Path(path)
    text = read_text_input(file, "cluster file")
    reader = csv.DictReader(text.splitlines())
    header = [name.strip().lower() for name in (reader.fieldnames or [])]
    columns: dict[str, str] = {}
    for key, names in _ALIASES.items():
        found = next((name for name in names if name in header), None)
        if found is not None:
            columns[key] = found
    if "name" not in columns or "gpus" not in columns:
        raise ValueError(f"{file}:1: cluster file needs columns name and gpus (found: {', '.join(header)})")
    reader.fieldnames = header
    nodes: list[NodeSpec] = []
    seen: set[str] = set()
    for row in reader:
        line = reader.line_num
        name = (row.get(columns["name"]) or "").strip()
        raw = (row.get(columns["gpus"]) or "").strip()
        if not name:
            raise ValueError(f"{file}:{line}: missing node name")
        if name in seen:
            raise ValueError(f"{file}:{line}: node {name!r} appears twice")
        seen.add(name)
        try:
            if not raw.isascii() or not raw.isdigit():
                raise ValueError
            gpus = int(raw)
        except ValueError:
            raise ValueError(f"{file}:{line}: GPU count must be an integer, got {raw!r}") from None
        if not 0 <= gpus <= MAX_GPUS_PER_NODE:
            raise ValueError(f"{file}:{line}: GPU count must be in [0, {MAX_GPUS_PER_NODE}], got {raw!r}")
        if gpus == 0:
            continue
        gpu_type = (row.get(columns["gpu_type"]) or "").strip() if "gpu_type" in columns else ""
        switch = (row.get(columns["switch"]) or "").strip() if "switch" in columns else ""
        nodes.append(NodeSpec(name, gpus, gpu_type, switch))
    if not nodes:
        raise ValueError(f"{file}: no node with GPUs")
    if len(nodes) > MAX_NODES:
        raise ValueError(f"{file}: {len(nodes)} nodes, at most {MAX_NODES}")
    return tuple(nodes)
