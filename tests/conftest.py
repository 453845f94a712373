import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# A persistent compilation cache per test process, set before anything
# imports jax (subprocesses inherit it). Test modules rebuild the same tiny
# programs again and again (a new trainer's jitted closures, a module's
# caches dropped below); a cache hit loads the executable instead of
# compiling it. A hit still logs "Finished XLA compilation", so the tests
# that count compilations see the same messages. Each pytest-xdist worker
# gets its own folder: jax writes an entry in place (no temporary file and
# rename), so a worker reading a program the other is writing can load a
# truncated executable.
_OURS = "JAXROLL_TESTS_JIT_CACHE"
if os.environ.get(_OURS) or "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _JIT_CACHE = tempfile.mkdtemp(prefix="jaxroll-tests-jit-")
  os.environ.update(JAX_COMPILATION_CACHE_DIR=_JIT_CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", **{_OURS: "1"})
else:  # the caller's own cache
  _JIT_CACHE = None


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: a longer test (CI runs it too)")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops jax's compiled programs after each test module: the suite runs in
  one process, and without this every module's executables (and the
  buffers their closures hold) stay alive to the end, a peak of several GB."""
  yield
  import gc

  import jax

  jax.clear_caches()
  gc.collect()


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
  """Builds (once per session) a random-weight HF checkpoint for an arch name."""
  pytest.importorskip("transformers")
  import hf_fixtures

  cache = {}

  def make(arch: str, tie: bool = False, **kw):
    key = (arch, tie, tuple(sorted(kw.items())))
    if key not in cache:
      folder = str(tmp_path_factory.mktemp(f"hf_{arch}_{'tied' if tie else 'untied'}"))
      cache[key] = hf_fixtures.save_random_hf_model(folder, arch, tie=tie, **kw)
    return cache[key]

  return make


def pytest_sessionfinish(session, exitstatus):
  if _JIT_CACHE:
    shutil.rmtree(_JIT_CACHE, ignore_errors=True)
