"""compile_cache: later processes load the programs earlier ones compiled,
with the same results; a run in the same process may name another folder."""

import json
import os
import subprocess
import sys

import pytest

from jaxroll import config as config_lib
from test_training import ROOT, read, tiny

# Without the test session's own cache (tests/conftest.py), which would
# hold the programs already.
CLEAN_ENV = {k: v for k, v in os.environ.items()
             if not k.startswith(("JAX_PERSISTENT_CACHE", "JAX_COMPILATION"))}


@pytest.mark.slow
def test_a_second_process_loads_the_programs_and_logs_the_same_run(tmp_path):
  cache = tmp_path / "xla"
  config = tmp_path / "tiny.json"
  config.write_text(json.dumps(config_lib.to_dict(tiny(str(tmp_path / "unused")))))
  compiled = []
  # The first process finds the folder empty and compiles every program;
  # the second loads them.
  for name in ("first", "second"):
    out = tmp_path / name
    subprocess.run([sys.executable, "-m", "jaxroll.cli", "train", str(config), "--set", f"run_dir={out}",
                    "--set", f"compile_cache={cache}"], cwd=ROOT, check=True, capture_output=True,
                   timeout=600, env=CLEAN_ENV)
    assert read(str(out), "metrics.jsonl") == read(str(tmp_path / "first"), "metrics.jsonl")
    timing = [json.loads(x) for x in read(str(out), "timing.jsonl").splitlines()]
    compiled.append(sum(t.get("step_xla_compile_s", 0) for t in timing))
  assert os.listdir(cache)
  # The cache's programs load in a fraction of their XLA compile time
  # (tracing and lowering remain).
  assert compiled[1] < 0.5 * compiled[0], compiled


# jax opens its cache at the first compile after a folder is named; the
# second folder must still receive the second program.
SWITCH = """
import os, sys
import jax, jax.numpy as jnp
from jaxroll import compile_cache

def program(n):
  def f(x):
    for i in range(n):
      x = jnp.sin(x) @ x + i
    return x
  return jax.jit(f)

jax.jit(lambda x: x + 1)(1.0)  # the process compiled before any folder was named
for folder, n in ((sys.argv[1], 120), (sys.argv[2], 121)):
  compile_cache.enable(folder)
  program(n)(jnp.ones((64, 64))).block_until_ready()
print(json.dumps([len(os.listdir(f)) for f in sys.argv[1:]]))
"""


def test_a_later_run_in_the_process_can_name_another_folder(tmp_path):
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  out = subprocess.run([sys.executable, "-c", "import json\n" + SWITCH, a, b], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=CLEAN_ENV, check=True)
  assert json.loads(out.stdout.strip().splitlines()[-1]) == [1, 1]
