"""Only the C extensions live here; every other piece of metadata is in setup.cfg."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hpc_elastic._detreduce",
            sources=["kernels/detreduce.c"],
            depends=["kernels/pybuffer.h"],
            # No -ffast-math and no FMA contraction: the kernels' bits must match the NumPy reference and
            # the CUDA twin on every machine.
            # OpenMP: the products' threads are the runtime's team, torch's own once torch is loaded (one
            # libgomp.so.1 in the process), instead of a second pool competing with it for the cores.
            extra_compile_args=["-O3", "-std=c11", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"],
            extra_link_args=["-fopenmp"],
        ),
        Extension(
            "hpc_elastic._dl2",
            sources=["kernels/dl2.c"],
            depends=["kernels/pybuffer.h"],
            # The same: the greedy loop's logits must be the bits of its single forward pass.
            extra_compile_args=["-O3", "-std=c11", "-ffp-contract=off", "-fno-fast-math"],
        ),
    ]
)
