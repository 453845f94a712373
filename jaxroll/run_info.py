"""What a run folder records so the run can be reproduced from it alone."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from typing import Any

import jax

PACKAGES = ("jaxroll", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy",
            "ml_dtypes", "tokenizers", "tensorboardX", "matplotlib", "math-verify")


def git_commit() -> str:
  """The jaxroll source commit (with "-dirty" when it has local changes), or "unknown"."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                            text=True, timeout=10, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True, timeout=10).stdout.strip()
    return commit + ("-dirty" if dirty else "")
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def package_versions() -> dict[str, str]:
  out = {}
  for name in PACKAGES:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = "not installed"
  return out


# The vector extensions XLA:CPU picks its kernels by: runs on CPUs that
# differ in them round differently, and a long run (the warm start's
# hundreds of steps) can end in a visibly different policy.
_CPU_ISA = ("avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "asimd", "sve")


def cpu() -> dict[str, Any]:
  """The CPU's model name and which of `_CPU_ISA` it has (Linux; else empty)."""
  try:
    with open("/proc/cpuinfo") as f:
      text = f.read()
  except OSError:
    return {}
  fields = {}
  for line in text.splitlines():
    key, _, value = line.partition(":")
    fields.setdefault(key.strip(), value.strip())
  flags = set((fields.get("flags") or fields.get("Features") or "").split())
  return {"model": fields.get("model name", "unknown"), "isa": [f for f in _CPU_ISA if f in flags]}


def collect(seed: int) -> dict[str, Any]:
  devices = jax.devices()
  return {
      "seed": seed,
      "git_commit": git_commit(),
      "packages": package_versions(),
      "python": platform.python_version(),
      "platform": platform.platform(),
      "processor": platform.processor() or platform.machine(),
      "cpu_count": os.cpu_count(),
      "cpu": cpu(),
      "jax_backend": jax.default_backend(),
      "devices": [f"{d.platform}:{d.device_kind}" for d in devices],
      "device_count": len(devices),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }
