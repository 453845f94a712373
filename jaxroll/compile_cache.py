"""JAX's persistent compilation cache, for runs that compile the same programs.

Every jaxroll process compiles its rollout and update programs on first
use: on the default task about 20 s, half of a 12-step run's wall-clock
(docs/benchmarks.md, the budget ladder). A resumed run, a rerun with
another seed, or the rungs of a ladder compile programs an earlier process
already compiled; with `compile_cache` set to a folder, XLA's executables
are stored there and later processes load them instead. The programs are
the same, so the results are too; only the seconds change, which is why
runs compared on wall-clock should agree on this setting (compare and
ladder refuse to mix them), while seconds net of compilation
(`cumulative_steady_s`) compare across it.
"""

from __future__ import annotations

import os

from jaxroll.config import ConfigError

# Programs that compile faster than this are not worth a file: the small
# helpers around the engine compile in milliseconds.
_MIN_COMPILE_S = 0.2


def check(folder: str) -> None:
  """A non-empty `folder` is, or can be made, a writable folder (before any work)."""
  if not folder:
    return
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"compile_cache={folder!r}: cannot create that folder ({e.strerror}); "
                      "name a writable folder, or set compile_cache='' to compile every time") from None
  if not os.access(folder, os.W_OK):
    raise ConfigError(f"compile_cache={folder!r} is not writable; name a writable folder, or set "
                      "compile_cache='' to compile every time")


def enable(folder: str) -> None:
  """Stores and loads this process's compiled programs in `folder` ('' leaves
  the process's setting, e.g. JAX_COMPILATION_CACHE_DIR, as it is)."""
  if not folder:
    return
  import jax
  from jax.experimental.compilation_cache import compilation_cache

  folder = os.path.abspath(folder)
  if jax.config.jax_compilation_cache_dir != folder:
    # jax opens its cache once per process, at the first compile after a
    # folder is named: a later run in the same process (compare, ladder,
    # tests) naming another folder would still write to the first.
    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", folder)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", _MIN_COMPILE_S)
