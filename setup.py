"""jaxroll: rollout-efficient RL for reasoning LLMs, in JAX.

`kernels/` is a top-level folder of the repository but installs as
`jaxroll.kernels` (a top-level package named `kernels` exists on PyPI).
"""
from setuptools import find_packages, setup

# Discovered, not listed: a new subpackage cannot be left out of a wheel
# (tests/test_packaging.py checks every source folder is found).
PACKAGES = find_packages(include=["jaxroll", "jaxroll.*"]) + ["jaxroll.kernels"]

setup(
    name="jaxroll",
    version="0.1.0",
    description="JAX-native, rollout-efficient RL for reasoning LLMs",
    python_requires=">=3.11",
    packages=PACKAGES,
    package_dir={"jaxroll.kernels": "kernels"},
    install_requires=[
        "jax>=0.10.2",
        "flax>=0.12.8",
        "optax>=0.2.8",
        "orbax-checkpoint",
        "grain",
        "numpy",
        "ml_dtypes",
        "tokenizers",
        "tensorboardX",
        "matplotlib",
        "math-verify",
        "pyarrow",
    ],
    entry_points={"console_scripts": ["jaxroll=jaxroll.cli:main"]},
    extras_require={
        # transformers/torch are only used as an independent reference in tests
        # and benchmarks; torch==2.13.0 is the CPU build.
        "test": ["pytest", "pytest-xdist", "scipy", "torch==2.13.0", "transformers", "safetensors"],
        # JetStream's Engine API; pulls TensorFlow through seqio (~3 GB).
        "jetstream": ["google-jetstream==0.2.2"],
    },
)
