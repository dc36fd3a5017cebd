"""The CUDA twin (kernels/detreduce_cuda.cu) compiles, with the flags hpc_elastic.est.gpu builds it with, into
device code that keeps the CPU kernels' arithmetic: every float operation rounds to nearest (``.rn``), none
flushes subnormals (no ``.ftz``), and the only fused multiply-adds are the D2 product's own (``fma.rn.f32`` in
``matmul_nt_kernel``, whose definition has one per step): the compiler contracts nothing.

Needs only ``nvcc`` (no GPU): the PTX is generated for sm_90 (H100) against torch's headers.  Running the kernels
and comparing their bits with the CPU's is tests/unit/kernels/test_detreduce.py's CUDA test, on a GPU.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

from hpc_elastic.est.gpu import NVCC_FLAGS, source_path

KERNELS = (
    "deposit_kernel",
    "combine_kernel",
    "tops_kernel",
    "fold_kernel",
    "finalize_kernel",
    "matmul_nt_kernel",
    "matmul_nt_lanes_kernel",
)
#: a CPU build of torch ships the CUDA headers but not this generated one; what a CUDA build's says
CMAKE_MACROS = "c10/cuda/impl/cuda_cmake_macros.h"


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    home = os.environ.get("CUDA_HOME")
    if found is None and home and (Path(home) / "bin" / "nvcc").is_file():
        found = str(Path(home) / "bin" / "nvcc")
    return found


@pytest.fixture(scope="module")
def ptx(tmp_path_factory: pytest.TempPathFactory) -> str:
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("no nvcc (CUDA toolkit) on this machine: the CUDA twin's build is not checked")
    tmp = tmp_path_factory.mktemp("cuda")
    includes = [*include_paths(), sysconfig.get_paths()["include"]]
    if not any((Path(p) / CMAKE_MACROS).is_file() for p in includes):
        stub = tmp / "include" / CMAKE_MACROS
        stub.parent.mkdir(parents=True)
        stub.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes.append(str(tmp / "include"))
    out = tmp / "detreduce.ptx"
    cmd = [nvcc, "-std=c++17", "-ptx", "-arch=sm_90", *NVCC_FLAGS, *(f"-I{p}" for p in includes)]
    run = subprocess.run(
        [*cmd, str(source_path()), "-o", str(out)], check=False, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return out.read_text()


def test_every_kernel_is_compiled(ptx: str) -> None:
    entries = re.findall(r"\.entry\s+(\S+)\(", ptx)
    for name in KERNELS:
        assert any(name in e for e in entries), f"{name} missing from the PTX entries {entries}"


def _float_ops(text: str) -> list[str]:
    return re.findall(r"^\s*((?:add|sub|mul|div|fma|cvt)\.[a-z0-9.]*f(?:32|64)[a-z0-9.]*)", text, re.MULTILINE)


def _entry_bodies(ptx: str) -> dict[str, str]:
    """Each kernel's PTX, by its (mangled) entry name."""
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"\.entry\s+(\S+)\(", ptx)]
    ends = [s for s, _ in starts[1:]] + [len(ptx)]
    return {name: ptx[s:e] for (s, name), e in zip(starts, ends, strict=True)}


def test_only_the_product_fuses_and_only_as_its_definition_says(ptx: str) -> None:
    bodies = _entry_bodies(ptx)
    for name, body in bodies.items():
        fused = [op for op in _float_ops(body) if op.startswith("fma")]
        if "matmul_nt" in name:  # matmul_nt_kernel and matmul_nt_lanes_kernel
            assert fused and set(fused) == {"fma.rn.f32"}, f"{name}: {sorted(set(fused))}"
            assert not [op for op in _float_ops(body) if op.startswith("mul")], "the product's steps are fmas"
        else:
            assert not fused, f"{name}: fused multiply-adds would change the bits"


def test_float_arithmetic_rounds_to_nearest_without_flush_to_zero(ptx: str) -> None:
    ops = _float_ops(ptx)
    assert ops, "no float arithmetic found in the PTX"
    assert not [op for op in ops if ".ftz" in op], "flush to zero would change the bits of subnormals"
    # every rounding operation rounds to nearest; only the exact widening conversion has no rounding mode
    assert all(".rn" in op or op == "cvt.f64.f32" for op in ops), sorted(set(ops))
