"""Cluster specifications and node files."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_elastic.sim.cluster import load_cluster_file, parse_cluster_spec
from tests.unit.sim.helpers import TRACES, needs_traces


def test_spec() -> None:
    nodes = parse_cluster_spec("15x4")
    assert len(nodes) == 15 and {n.gpus for n in nodes} == {4} and len({n.name for n in nodes}) == 15


@pytest.mark.parametrize("bad", ["15", "0x4", "4x0", "ax4", "", "100001x4", "4x65", "99999999x99999999"])
def test_bad_spec(bad: str) -> None:
    with pytest.raises(ValueError, match="cluster"):
        parse_cluster_spec(bad)


def test_node_file(tmp_path: Path) -> None:
    path = tmp_path / "nodes.csv"
    path.write_text("name,gpus,gpu_type,switch\na,4,v100,s1\nb,8,a100,s2\nc,0,,s2\n")
    nodes = load_cluster_file(path)
    assert [(n.name, n.gpus, n.gpu_type, n.switch) for n in nodes] == [("a", 4, "v100", "s1"), ("b", 8, "a100", "s2")]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("host,count\na,4\n", "needs columns name and gpus"),
        ("name,gpus\na,four\n", r":2: GPU count must be an integer, got 'four'"),
        ("name,gpus\na,4\na,4\n", r":3: node 'a' appears twice"),
        ("name,gpus\na,0\n", "no node with GPUs"),
    ],
)
def test_bad_node_file(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "nodes.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_cluster_file(path)


@needs_traces
def test_openb_node_list() -> None:
    nodes = load_cluster_file(TRACES / "alibaba_openb" / "openb_node_list_gpu_node.csv")
    assert len(nodes) == 1213 and sum(n.gpus for n in nodes) == 6212
    assert {n.gpu_type for n in nodes} == {"G2", "T4", "G3", "P100", "V100M32", "V100M16", "A10"}
