"""Multi-host runs on JAX's own multi-controller runtime (one process per host).

`initialize` wraps `jax.distributed.initialize`: from arguments, from the
JAXROLL_COORDINATOR / JAXROLL_NUM_PROCESSES / JAXROLL_PROCESS_ID environment
variables, or, with JAXROLL_DISTRIBUTED=auto, from what JAX detects itself
(TPU pod slices, SLURM). With none of these it does nothing: one process.
Every process then runs the same program over the global mesh.
"""

from __future__ import annotations

import os

import jax
import numpy as np


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, initialization_timeout: int = 300) -> None:
  """Joins the job's processes; a no-op for a single process.

  Call it before anything touches a device (jax.devices(), arrays, jit).
  """
  coordinator_address = coordinator_address or os.environ.get("JAXROLL_COORDINATOR") or None
  if num_processes is None and "JAXROLL_NUM_PROCESSES" in os.environ:
    num_processes = int(os.environ["JAXROLL_NUM_PROCESSES"])
  if process_id is None and "JAXROLL_PROCESS_ID" in os.environ:
    process_id = int(os.environ["JAXROLL_PROCESS_ID"])
  if num_processes == 1:
    return
  if coordinator_address is None and num_processes is None:
    if os.environ.get("JAXROLL_DISTRIBUTED") == "auto":
      jax.distributed.initialize(initialization_timeout=initialization_timeout)
    return
  if (coordinator_address is None) != (num_processes is None):
    raise ValueError("set both the coordinator address and the number of processes, or neither "
                     f"(got coordinator={coordinator_address!r}, num_processes={num_processes})")
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                             process_id=process_id, initialization_timeout=initialization_timeout)


def shutdown() -> None:
  jax.distributed.shutdown()


# -- helpers the training loop uses; each is the identity in a single process --

def is_main() -> bool:
  """The process that writes run files (every process takes part in checkpoints)."""
  return jax.process_index() == 0


def process_rows(total: int, what: str) -> slice:
  """This process's contiguous share of `total` rows (they must divide evenly)."""
  n, i = jax.process_count(), jax.process_index()
  if total % n:
    raise ValueError(f"{what}={total} must be divisible by the {n} processes")
  return slice(i * total // n, (i + 1) * total // n)


def _allgather(x: np.ndarray) -> np.ndarray:
  """Every process's `x` (one shape on all), stacked in process order."""
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def gather_rows(x):
  """Concatenates every process's rows of a host array, in process order.

  Processes may hold different numbers of rows (a filter can leave one
  short): the counts are gathered first and the rows padded to the most,
  since a collective needs one shape everywhere."""
  if jax.process_count() == 1:
    return x
  x = np.asarray(x)
  counts = _allgather(np.array(x.shape[0], np.int64))
  padded = np.zeros((int(counts.max()), *x.shape[1:]), x.dtype)
  padded[:x.shape[0]] = x
  rows = _allgather(padded)
  return np.concatenate([rows[i, :int(n)] for i, n in enumerate(counts)])


def gather_json(obj) -> list:
  """Every process's JSON-serialisable `obj`, in process order, on every process."""
  import json

  if jax.process_count() == 1:
    return [obj]
  data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
  sizes = _allgather(np.array(data.size, np.int64))
  buf = np.zeros(int(sizes.max()), np.uint8)
  buf[:data.size] = data
  rows = _allgather(buf)
  return [json.loads(bytes(rows[i, :int(n)])) for i, n in enumerate(sizes)]


def gather_tree(tree):
  """The full value of every global array spanning several hosts, on every host.

  Arrays this process already holds whole (e.g. before they are placed on
  the global mesh) are returned as they are.
  """
  if jax.process_count() == 1:
    return tree
  from jax.experimental import multihost_utils

  return jax.tree.map(lambda x: x if x.is_fully_addressable else
                      multihost_utils.process_allgather(x, tiled=True), tree)


def global_rows(local, sharding, total_rows: int):
  """A global array of `total_rows` rows from this process's rows (batch-sharded)."""
  if jax.process_count() == 1:
    return jax.device_put(local, sharding)
  return jax.make_array_from_process_local_data(sharding, local, (total_rows, *local.shape[1:]))


def barrier(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
