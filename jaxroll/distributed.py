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
