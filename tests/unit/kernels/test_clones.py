"""Every instruction-set clone of the C kernels gives the same bits.

The package build compiles the hot loops of kernels/detreduce.c for AVX-512 (x86-64-v4), AVX2 and baseline x86-64
(GCC ``target_clones``); the loader picks one by the CPU, so the installed module only ever runs this machine's.
Here the file is built once per instruction set this CPU can run, with the clones off (``-DDETREDUCE_NO_CLONES``,
``-march=...``), and every build must give the bits of the NumPy reference on the same data: values over the whole
fp32 range (subnormals, zeros, both signs), a chunk with an infinity, several ESTs whose top bins rise between
deposits; the D2 batch norm and exp kernels against their torch definitions, the padded images against F.pad,
the stencil (depthwise convolutions) against the product.
"""

from __future__ import annotations

import importlib.util
import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from hpc_elastic.est import d2_math
from hpc_elastic.est import detsum as d
from tests.conftest import REPO
from tests.unit.est.test_d2_ops import exp_kernel_inputs

SOURCE = REPO / "kernels" / "detreduce.c"
#: the package build's flags (setup.py)
FLAGS = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"]
#: instruction sets and the CPU flags each needs
ARCHES = {
    "x86-64": (),
    "x86-64-v3": ("avx2", "fma", "bmi2"),
    "x86-64-v4": ("avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512cd"),
}
CHUNK = 64
N_EST = 5


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


def _load(so: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, so)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {so}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_each_arch(tmp_path_factory: pytest.TempPathFactory, source: Path, module: str) -> dict[str, ModuleType]:
    """``source`` built as the extension ``module`` once per instruction set this CPU runs, with the package
    build's flags and its clones off (``-D<MODULE>_NO_CLONES``); skips where that cannot be done."""
    if platform.machine() != "x86_64":
        pytest.skip(f"the clones are x86-64 ones; this machine is {platform.machine()}")
    cc = shutil.which("gcc")
    if cc is None:
        pytest.skip("no gcc to build the kernels per instruction set")
    flags = _cpu_flags()
    out: dict[str, ModuleType] = {}
    for arch, needs in ARCHES.items():
        if not set(needs) <= flags:
            continue  # this CPU cannot run that build
        target = tmp_path_factory.mktemp(arch) / f"{module}{sysconfig.get_config_var('EXT_SUFFIX')}"
        include = sysconfig.get_paths()["include"]
        no_clones = f"-D{module.strip('_').upper()}_NO_CLONES"
        subprocess.run(
            [cc, *FLAGS, no_clones, f"-march={arch}", f"-I{include}", str(source), "-o", str(target)],
            check=True,
            capture_output=True,
            timeout=300,
        )
        out[arch] = _load(target, module)
    return out


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, d.CKernels]:
    return {arch: d.CKernels(m) for arch, m in build_each_arch(tmp_path_factory, SOURCE, "_detreduce").items()}


def _contributions(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    xs = []
    for j in range(N_EST):
        # sign * 2^e * m over fp32's whole range, including subnormals; later ESTs reach higher, so tops rise
        e = rng.integers(-150, 60 + 10 * j, n)
        x = (rng.choice([-1.0, 1.0], n) * np.ldexp(rng.uniform(1.0, 2.0, n), e)).astype(np.float32)
        x[rng.random(n) < 0.05] = 0.0
        xs.append(x)
    xs[2][CHUNK + 3] = np.inf  # one non-finite chunk
    return xs


def _outputs(kern: d.Kernels, xs: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Every kernel's output on ``xs``: the binned path (deposits, combine, finalize; deposits, tops, fold), the
    owner's path (owner_sum, finalize) and the fixed-order matmul."""
    n = xs[0].size
    width = d.bin_width(len(xs))
    nch = d.num_chunks(n, CHUNK)
    hi, lo, tops = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(nch, np.uint8)
    for j, x in enumerate(xs):
        kern.deposit(x.copy(), hi, lo, tops, chunk=CHUNK, width=width, first=j == 0, clear=True)
    binned_hi, binned_lo = hi.copy(), lo.copy()
    kern.combine(hi, lo, tops, tops.copy(), chunk=CHUNK, width=width)
    binned = np.empty(n, np.float32)
    kern.finalize(hi, tops, binned, chunk=CHUNK, width=width, divisor=float(len(xs)))
    # the runtime's way: all but the last EST deposited, the last folded in on the MAX of the top bins
    hi2, lo2, bin_tops, last_tops = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(nch, np.uint8), tops.copy()
    for j, x in enumerate(xs[:-1]):
        kern.deposit(x.copy(), hi2, lo2, bin_tops, chunk=CHUNK, width=width, first=j == 0, clear=True)
    kern.tops(xs[-1], last_tops, chunk=CHUNK, width=width)
    kern.fold(xs[-1], hi2, lo2, bin_tops, np.maximum(bin_tops, last_tops), chunk=CHUNK, width=width, have_bins=True)
    acc, owner_tops = np.empty(n, np.int64), np.empty(nch, np.uint8)
    kern.owner_sum(np.stack(xs), acc, owner_tops, chunk=CHUNK, width=width)
    owner = np.empty(n, np.float32)
    kern.finalize(acc, owner_tops, owner, chunk=CHUNK, width=width, divisor=3.0)
    # no overflow in the products; k = 1029 spans three chunks of k and a tail after the 8-lane steps, n = 5 is a
    # partial panel of outputs
    a = np.clip(np.nan_to_num(np.stack(xs)[:, :1029], posinf=1.0), -1e12, 1e12)
    mm = np.empty((N_EST, N_EST), np.float32)
    kern.matmul_nt(a, a, mm)
    # the same rows read in place: a's columns with stride 3 (packed), b's rows interleaved (stride 1, k-stride N_EST)
    flat = np.ascontiguousarray(a.T).reshape(-1)
    geometry = np.array([0, 1, 1, N_EST, 343, 1, 3 * N_EST], np.int64)
    mm_view = np.empty((N_EST, N_EST), np.float32)
    kern.matmul_nt_view(flat, geometry, flat, geometry, mm_view, rows=(0, N_EST))
    return {
        "hi": binned_hi,
        "lo": binned_lo,
        "tops": tops,
        "combined": hi,
        "last_tops": last_tops,
        "folded": hi2,
        "binned": binned,
        "acc": acc,
        "owner_tops": owner_tops,
        "owner": owner,
        "matmul": mm,
        "matmul_view": mm_view,
    }


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_instruction_set_gives_the_reference_bits(builds: dict[str, d.CKernels], seed: int) -> None:
    assert "x86-64" in builds  # every x86-64 CPU runs the baseline build
    xs = _contributions(seed, 20 * CHUNK + 17)
    want = _outputs(d.ReferenceKernels(), xs)
    assert np.isnan(want["owner"][CHUNK]) and np.isfinite(want["owner"][0])  # the data reach both cases
    assert np.array_equal(want["folded"], want["combined"])  # folding the last EST in is depositing it
    for arch, kern in builds.items():
        got = _outputs(kern, xs)
        for name, value in want.items():
            assert np.array_equal(_bits(got[name]), _bits(value)), f"{arch}: {name} differs from the reference"


def test_each_build_runs_the_product_path_of_its_instruction_set(builds: dict[str, d.CKernels]) -> None:
    """With the clones off, a build's product runs the widest path its instruction set has: so the reference test
    above covers fmaf lane by lane (x86-64), the AVX2 blocks (x86-64-v3) and the AVX-512 blocks (x86-64-v4)."""
    widest = {"x86-64": "scalar", "x86-64-v3": "avx2", "x86-64-v4": "avx512"}
    for arch, kern in builds.items():
        assert kern._m._matmul_path() == widest[arch], arch


@pytest.mark.parametrize("shape", [(5, 3, 32, 32), (3, 2, 20, 33), (4, 3, 8, 8), (6, 2)])
def test_every_instruction_set_gives_the_batch_norm_definitions_bits(
    builds: dict[str, d.CKernels], shape: tuple[int, ...]
) -> None:
    """The batch norm kernels' row trees and element passes (vectorised per instruction set) against their
    definition in torch operations (d2_math's, the CUDA path): the same bits from every build."""
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-20, 20, shape, generator=gen).float())
    x.view(-1)[::7] = -0.0
    g = torch.randn(shape, generator=gen)
    c = shape[1]
    weight, bias = torch.randn(c, generator=gen), torch.randn(c, generator=gen)
    want = d2_math.batch_norm_train_torch(x, weight, bias, 1e-5)
    want_gx, want_gw, want_gb = d2_math.batch_norm_train_backward_torch(g, want.xhat, want.invstd, weight, True)
    assert want_gx is not None
    sizes = np.array(shape[2:], np.int64)
    for arch, kern in builds.items():
        got = [np.empty(shape, np.float32) for _ in range(2)] + [np.empty(c, np.float32) for _ in range(3)]
        kern._m.batch_norm_forward(x.numpy(), *got, weight.numpy(), bias.numpy(), shape[0], c, sizes, 1e-5)
        for name, a, b in zip(want._fields, got, want, strict=True):
            assert np.array_equal(_bits(a), _bits(b.numpy())), f"{arch}: {name}"
        grads = [np.empty(shape, np.float32), np.empty(c, np.float32), np.empty(c, np.float32)]
        kern._m.batch_norm_backward(
            g.numpy(), want.xhat.numpy(), want.invstd.numpy(), weight.numpy(), *grads, shape[0], c, sizes
        )
        for name, a, b in zip(("gx", "gw", "gb"), grads, (want_gx, want_gw, want_gb), strict=True):
            assert np.array_equal(_bits(a), _bits(b.numpy())), f"{arch}: {name}"


@pytest.mark.parametrize("fn", [0, 1, 2, 3], ids=["exp", "expm1", "sigmoid", "tanh"])
def test_every_instruction_set_gives_the_exp_definitions_bits(
    builds: dict[str, d.CKernels], fn: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The element loops of exp, expm1, sigmoid and tanh (branch-free, vectorised per instruction set) against their
    definition in torch operations (d2_math's, the CUDA path), on the D2 operator tests' inputs for the kernel."""
    definition = (d2_math.det_exp, d2_math.det_expm1, d2_math.det_sigmoid, d2_math.det_tanh)[fn]
    x = exp_kernel_inputs(fn, 200_000)
    monkeypatch.setattr(d2_math, "c_kernels", lambda: None)
    want = definition(torch.from_numpy(x)).numpy()
    for arch, kern in builds.items():
        got = np.empty_like(x)
        kern._m.exp(x, got, d2_math._EXP_CONSTANTS, fn)
        assert np.array_equal(_bits(got), _bits(want)), f"{arch}: fn {fn}"


@pytest.mark.parametrize("channels_last", [True, False])
def test_every_instruction_set_pads_images_to_the_same_bits(builds: dict[str, d.CKernels], channels_last: bool) -> None:
    """The padded images D2's convolutions read (8 x 8 blocks by the AVX shuffles of the product's packing in the
    builds with AVX2, element by element in the baseline one) are F.pad's bits in every build: whole blocks and
    edges (19 channels, width 21)."""
    n, c, h, w = 3, 19, 6, 21
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(n, c, h, w, generator=gen)
    x.view(-1)[::9] = -0.0
    x.view(torch.int32).view(-1)[1::13] = 0x7FC0_0042  # a NaN with a payload
    padded = torch.nn.functional.pad(x, (2, 1, 1, 3))
    want = (padded.permute(0, 2, 3, 1).contiguous() if channels_last else padded).numpy()
    geometry = np.array([n, c, h, w, 1, 3, 2, 1], np.int64)
    for arch, kern in builds.items():
        got = np.empty_like(want)
        kern._m.pad_image(x.numpy(), got, geometry, channels_last, 2)
        assert np.array_equal(_bits(got), _bits(want)), f"{arch}: channels_last {channels_last}"


def test_every_instruction_set_gives_the_stencils_product_bits(builds: dict[str, d.CKernels]) -> None:
    """The stencil kernel (a depthwise convolution's dot products, vectorised along a row's outputs per instruction
    set) against the fixed-order product of the gathered windows: the same bits from every build, with a ragged run
    of outputs (width 21) and 11 taps (lanes 0-2 reached twice)."""
    planes, c, hp, wp, th, tw = 6, 3, 9, 30, 4, 21
    gen = torch.Generator().manual_seed(11)
    img = torch.randn(planes, hp, wp, generator=gen) * torch.exp2(torch.randint(-9, 9, (planes, hp, wp), generator=gen))
    img.view(-1)[::7] = -0.0
    offsets = np.array([0, 1, 2, wp, wp + 4, 2 * wp, 2 * wp + 1, 3 * wp + 3, 4 * wp, 4 * wp + 5, 4 * wp + 8], np.int64)
    weights = torch.randn(c, len(offsets), generator=gen)
    y0, x0, sy = 1, 0, 1
    rows = [(y0 + t * sy) * wp + x0 + u for t in range(th) for u in range(tw)]
    windows = img.reshape(planes, -1)[:, torch.tensor(rows)[:, None] + torch.from_numpy(offsets)[None, :]]
    want = torch.stack([d2_math.det_matmul_nt(weights[p % c : p % c + 1], windows[p])[0] for p in range(planes)])
    geometry = np.array([planes, hp, wp, c, y0, x0, sy, 1, th, tw, 0, th * tw, tw, 1], np.int64)
    for arch, kern in builds.items():
        got = np.empty((planes, th, tw), np.float32)
        kern._m.stencil(img.numpy(), weights.numpy(), offsets, got, geometry, 2)
        assert np.array_equal(_bits(got), _bits(want.reshape(planes, th, tw).numpy())), arch


def test_every_instruction_set_gives_the_weight_gradients_product_bits(builds: dict[str, d.CKernels]) -> None:
    """The depthwise weight gradient's kernel (runs of 8 outputs from lane 0 as one vector step, the rest lane by
    lane) against the fixed-order product of the gathered columns: the same bits from every build, rows of 13
    outputs (the lanes shift from row to row), rows 2 apart."""
    n, c, hp, wp, th, tw, sy, sx = 3, 4, 12, 30, 5, 13, 2, 1
    gen = torch.Generator().manual_seed(12)
    img = torch.randn(n * c, hp, wp, generator=gen)
    img.view(-1)[::5] = -0.0
    g = torch.randn(n, c, th, tw, generator=gen)
    offsets = np.array([0, 1, 2, wp, 2 * wp + 1], np.int64)
    cols = torch.tensor([(y * sy) * wp + x * sx for y in range(th) for x in range(tw)])
    want = torch.empty(c, len(offsets))
    for ch in range(c):
        planes = img.reshape(n, c, -1)[:, ch]  # [n, hp * wp]
        columns = torch.stack([planes[:, cols + int(o)].reshape(-1) for o in offsets])  # [taps, (n, y, x)]
        want[ch] = d2_math.det_matmul_nt(g[:, ch].reshape(1, -1), columns)[0]
    geometry = np.array([n, c, hp, wp, 0, 0, sy, sx, th, tw], np.int64)
    for arch, kern in builds.items():
        got = np.empty((c, len(offsets)), np.float32)
        kern._m.stencil_weight_grad(img.numpy(), g.numpy(), offsets, got, geometry, 2)
        assert np.array_equal(_bits(got), _bits(want.numpy())), arch
