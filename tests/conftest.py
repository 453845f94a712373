import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# One persistent compilation cache for the whole test session, set before
# anything imports jax: the pytest-xdist workers and the subprocesses tests
# start inherit it from the controlling process. Test modules rebuild the
# same tiny programs again and again (a new trainer's jitted closures, a
# module's caches dropped below), in both workers; a hit loads the
# executable instead of compiling it. A hit still logs "Finished XLA
# compilation", so the tests that count compilations see the same messages.
_OURS = "JAXROLL_TESTS_JIT_CACHE"
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _JIT_CACHE = tempfile.mkdtemp(prefix="jaxroll-tests-jit-")
  os.environ.update(JAX_COMPILATION_CACHE_DIR=_JIT_CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", **{_OURS: "1"})
else:  # the controlling process's cache (or the caller's own): not ours to delete
  _JIT_CACHE = None


def _write_cache_entries_atomically():
  """jax writes a cache entry in place, so a process reading it meanwhile
  can see part of it. jax then only warns and compiles again (a truncated
  entry fails to decompress), but the test processes write each entry to a
  temporary file and rename it instead. A jax without this private API
  keeps its own writes."""
  try:
    from jax._src import lru_cache
  except ImportError:
    return
  cls = getattr(lru_cache, "LRUCache", None)
  if cls is None or not hasattr(cls, "put"):
    return
  jax_put = cls.put

  def put(self, key: str, value: bytes) -> None:
    if getattr(self, "eviction_enabled", True) or not key:
      return jax_put(self, key, value)
    path = os.path.join(str(self.path), key + getattr(lru_cache, "_CACHE_SUFFIX", "-cache"))
    if os.path.exists(path):
      return
    fd, tmp = tempfile.mkstemp(dir=str(self.path), prefix=".partial-")
    with os.fdopen(fd, "wb") as f:
      f.write(value)
    os.replace(tmp, path)

  cls.put = put


if os.environ.get(_OURS):
  _write_cache_entries_atomically()


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
