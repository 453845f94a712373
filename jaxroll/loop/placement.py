"""Where a run's arrays live: the training mesh, the rollout mesh, and the
weights handed from one to the other.

Colocated, both sides share one mesh (or none on a single device);
disaggregated, the first `mesh.rollout_devices` devices sample and the rest
train, and each publication is an explicit transfer; with several
processes every host samples on its own devices from a full copy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxroll import distributed, sharding


def make_meshes(mesh_cfg, multi: bool):
  """(training mesh, rollout mesh): both None on a single unplaced device."""
  m = mesh_cfg
  shape = {"data": m.data, "fsdp": m.fsdp, "tensor": m.tensor}
  if multi:
    if m.placement != "colocated":
      raise sharding.ShardingError("multi-process runs use mesh.placement='colocated' "
                                   "(each host samples on its own devices)")
    return sharding.make_mesh(shape), sharding.make_mesh({"data": -1}, jax.local_devices())
  if m.placement == "colocated":
    if (m.data, m.fsdp, m.tensor) == (1, 1, 1):
      return None, None
    mesh = sharding.make_mesh(shape)
    return mesh, mesh
  devices = jax.devices()
  if not 0 < m.rollout_devices < len(devices):
    raise sharding.ShardingError(
        f"mesh.rollout_devices={m.rollout_devices} must leave training at least one of the "
        f"{len(devices)} devices")
  return (sharding.make_mesh(shape, devices[m.rollout_devices:]),
          sharding.make_mesh({"data": m.rollout_devices}, devices[:m.rollout_devices]))


class Placement:
  """The meshes of a run and the moves between them.

  Args:
    cfg: the experiment config (mesh, rollout.param_dtype, pipeline.mode).
  """

  def __init__(self, cfg):
    self.multi = jax.process_count() > 1
    self.mesh, self.rollout_mesh = make_meshes(cfg.mesh, self.multi)
    self.sampler_dtype = None if cfg.rollout.param_dtype == "float32" else jnp.bfloat16
    # With the rollout thread the sampler keeps published weights while the
    # next update donates the trainer's buffers.
    self.own_copy = cfg.pipeline.mode != "sync"
    self.state_shardings = None

  def set_state(self, params, tx) -> None:
    """Derives the shardings of parameters and optimiser state (none without a mesh)."""
    if self.mesh is None:
      return
    param_sh = sharding.param_shardings(params, self.mesh)
    opt_abstract = jax.eval_shape(tx.init, params)
    self.state_shardings = param_sh, sharding.optimizer_shardings(opt_abstract, param_sh, self.mesh)

  @property
  def row_multiple(self) -> int:
    """What a batch's row count must divide into: the mesh's data-parallel size."""
    if self.mesh is None:
      return 1
    return int(np.prod([self.mesh.shape[a] for a in ("data", "fsdp") if a in self.mesh.shape] or [1]))

  def place_state(self, params, opt_state):
    """Puts parameters and optimiser state on the mesh (without one,
    committed to one device: see sharding.commit_to_one_device)."""
    if self.mesh is None:
      return sharding.commit_to_one_device((params, opt_state))
    return (sharding.shard_like(params, self.state_shardings[0]),
            sharding.shard_like(opt_state, self.state_shardings[1]))

  def place_batch(self, batch):
    if self.mesh is None:
      return batch
    rows = jax.tree.leaves(batch)[0].shape[0] * jax.process_count()  # any row-major pytree
    return jax.tree.map(lambda x: distributed.global_rows(
        x, sharding.batch_sharding(self.mesh, x.ndim, rows=rows), rows), batch)

  def publish(self, engine, params, version: int, **load_kw):
    """Hands weights to the sampler; returns (decode params, bytes moved between meshes).
    `load_kw`: more arguments for engine.load (a rollout head)."""
    moved = 0
    if self.multi:
      # Every host samples with a full copy of the new weights.
      params = distributed.gather_tree(params)
    if self.rollout_mesh is not None and self.rollout_mesh is not self.mesh:
      # Disaggregated: an explicit transfer onto the rollout devices.
      params = sharding.shard_like(params, sharding.param_shardings(params, self.rollout_mesh))
      # One copy of what was published (docs/scaling.md: x replicas for the total).
      moved = sum(x.nbytes for x in jax.tree.leaves(params))
    if self.own_copy and moved == 0:
      params = jax.tree.map(lambda x: x.copy(), params)
    return engine.load(params, version=version, dtype=self.sampler_dtype, **load_kw), moved
