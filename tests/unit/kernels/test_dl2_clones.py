"""Every instruction-set clone of DL²'s inference kernel gives the same bits.

The package build compiles kernels/dl2.c's dense loops for AVX-512 (x86-64-v4), AVX2 and baseline x86-64 (GCC
``target_clones``); the installed module runs this CPU's widest. Here the file is built once per instruction set
this CPU can run, with the clones off (``-DDL2_NO_CLONES``, ``-march=...``): every build's forward pass must give
the bits of the fixed-order definition, and its greedy loop the installed module's actions.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

from hpc_elastic import _dl2
from hpc_elastic.policy import dl2 as policy
from hpc_elastic.policy.dl2 import Network, decide
from hpc_elastic.policy.slots import Servers, SlotJob
from tests.conftest import REPO
from tests.unit.kernels.test_clones import build_each_arch
from tests.unit.policy.test_dl2_state import SPEC, normal_layers, reference_forward, slot
from tests.unit.policy.test_dl2_state import random_network as integer_network

SOURCE = REPO / "kernels" / "dl2.c"


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModuleType]:
    return build_each_arch(tmp_path_factory, SOURCE, "_dl2")


def test_every_instruction_set_gives_the_definitions_logits(builds: dict[str, ModuleType]) -> None:
    assert "x86-64" in builds  # every x86-64 CPU runs the baseline build
    rng = np.random.default_rng(8)
    # widths that are not multiples of the vectors' 4, 8 and 16 lanes
    layers = normal_layers(rng, SPEC.state_size, 37, 19, SPEC.action_size)
    rows = normal_layers(rng, SPEC.columns + 1, 21, 3)
    network = Network(layers, rows, SPEC.columns)
    for _ in range(10):
        state = rng.random(SPEC.state_size) * (rng.random(SPEC.state_size) < 0.6)
        want = reference_forward(layers, rows, SPEC.columns, state).astype(np.float32)
        for arch, module in builds.items():
            got = np.empty(SPEC.action_size, dtype=np.float32)
            module.forward(network.dims, network.weights, SPEC.jobs, SPEC.columns, state.astype(np.float32), got)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), arch


def test_every_instruction_set_decides_like_the_installed_module(
    builds: dict[str, ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(9)
    for trial in range(20):
        jobs = tuple(
            SlotJob(k, int(rng.integers(0, 2)), k, float(rng.uniform(10, 100)), max_workers=4, max_ps=3)
            for k in range(int(rng.integers(1, 8)))
        )
        inp = slot(jobs, Servers.uniform(int(rng.integers(1, 4)), 2, 8))
        network = integer_network(rng, depth=2, head=trial % 2 == 0, spread=1.0)
        want = decide(SPEC, inp, network)
        for arch, module in builds.items():
            monkeypatch.setattr(policy, "_dl2", module)
            assert decide(SPEC, inp, network) == want, (arch, trial)
            monkeypatch.setattr(policy, "_dl2", _dl2)
