"""The one compiled part: on Linux, ferrum_mac/backends/mlx/cpu/_cpu_blas.c (MLX's CPU matmuls on
numpy's OpenBLAS; see ferrum_mac/backends/mlx/cpu/blas.py). Optional: without a C compiler
the install still succeeds and MLX keeps the BLAS its wheel bundles. Everything else is in
pyproject.toml."""

import sys

from setuptools import Extension, setup

ext_modules = []
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "ferrum_mac.backends.mlx.cpu._cpu_blas",
            ["ferrum_mac/backends/mlx/cpu/_cpu_blas.c"],
            libraries=["dl"],
            optional=True,
        )
    )

setup(ext_modules=ext_modules)
