"""Meshes, logical-axis rules and parameter placement (the pjit model).

Every parameter dimension has a logical name ("embed", "mlp", "heads",
"vocab"); rules map logical names to mesh axes ("data", "fsdp", "tensor").
The same code runs on one device (a 1x1x1 mesh) and on many: `jax.jit`
propagates the layout from the placed inputs, and the out-shardings keep
the updated parameters where they were.

A dimension that a mesh axis does not divide stays replicated on that axis
(small test models have dimensions like 48); `describe_layout` reports it.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxroll.errors import JaxrollError

MESH_AXES = ("data", "fsdp", "tensor")

# Logical dimension -> mesh axis (or a tuple of axes, or None: replicated).
DEFAULT_RULES: dict[str, Any] = {
    "batch": ("data", "fsdp"),  # rows of a training batch / decode slots
    "embed": "fsdp",  # the model width: FSDP shards parameters along it
    "mlp": "tensor",  # MLP hidden units: tensor (Megatron-style) parallelism
    "heads": "tensor",  # fused q|k|v outputs and the attention output's input
    "vocab": "tensor",
    "norm": None,
}

# Parameter path (joined with "/") -> logical names of its dimensions.
_PARAM_AXES = (
    (r"embed/embedding$", ("vocab", "embed")),
    (r"attn/qkv/kernel$", ("embed", "heads")),
    (r"attn/qkv/bias$", ("heads",)),
    (r"attn/out/kernel$", ("heads", "embed")),
    (r"mlp/gate_up/kernel$", ("embed", "mlp")),
    (r"mlp/down/kernel$", ("mlp", "embed")),
    (r"lm_head/kernel$", ("embed", "vocab")),
    (r"(norm|final_norm)/scale$", ("norm",)),
)


class ShardingError(JaxrollError, ValueError):
  """A mesh or a sharding rule cannot be used (raised before any compilation)."""


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh with axes ("data", "fsdp", "tensor") over `devices` (default: all).

  Args:
    shape: sizes per axis name; missing axes are 1, and at most one axis may
      be -1 (takes the remaining devices).
  """
  devices = list(jax.devices() if devices is None else devices)
  unknown = set(shape) - set(MESH_AXES)
  if unknown:
    raise ShardingError(f"unknown mesh axes {sorted(unknown)}; the axes are {MESH_AXES}")
  sizes = {a: int(shape.get(a, 1)) for a in MESH_AXES}
  fill = [a for a, s in sizes.items() if s == -1]
  if len(fill) > 1:
    raise ShardingError(f"only one mesh axis may be -1, got {fill}")
  if any(s == 0 or s < -1 for s in sizes.values()):
    raise ShardingError(f"mesh axis sizes must be positive (or one -1), got {sizes}")
  if fill:
    rest = math.prod(s for s in sizes.values() if s != -1)
    if len(devices) % rest:
      raise ShardingError(f"mesh {sizes} does not divide the {len(devices)} devices")
    sizes[fill[0]] = len(devices) // rest
  if math.prod(sizes.values()) != len(devices):
    raise ShardingError(f"mesh {sizes} has {math.prod(sizes.values())} positions but there are "
                        f"{len(devices)} devices; the product of the axis sizes must equal it")
  grid = np.asarray(devices, dtype=object).reshape([sizes[a] for a in MESH_AXES])
  return Mesh(grid, MESH_AXES)


def validate_rules(rules: Mapping[str, Any], mesh: Mesh) -> None:
  for logical, axes in rules.items():
    for axis in (axes if isinstance(axes, tuple) else (axes,)):
      if axis is not None and axis not in mesh.axis_names:
        raise ShardingError(f"sharding rule {logical!r} -> {axis!r} names an unknown mesh axis; "
                            f"the mesh has {mesh.axis_names}")


def param_logical_axes(path: str, ndim: int) -> tuple:
  for pattern, names in _PARAM_AXES:
    if re.search(pattern, path):
      if len(names) != ndim:
        raise ShardingError(f"parameter {path} has {ndim} dims but its rule names {names}")
      return names
  raise ShardingError(f"no logical axes for parameter {path}; add it to jaxroll.sharding._PARAM_AXES")


def spec_for(shape: Sequence[int], logical: Sequence[str | None], mesh: Mesh,
             rules: Mapping[str, Any] = DEFAULT_RULES) -> PartitionSpec:
  """The PartitionSpec for an array; axes that do not divide a dimension are dropped."""
  out = []
  for dim, name in zip(shape, logical):
    axes = rules.get(name) if name is not None else None
    axes = tuple(a for a in (axes if isinstance(axes, tuple) else (axes,)) if a is not None)
    # Keep the axes that divide the dimension (in order), so small models
    # still run on big meshes, replicated where they cannot be split.
    kept, size = [], 1
    for a in axes:
      if dim % (size * mesh.shape[a]) == 0:
        kept.append(a)
        size *= mesh.shape[a]
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*out)


def _path_str(path) -> str:
  parts = []
  for p in path:
    for attr in ("key", "idx", "name"):
      if hasattr(p, attr):
        parts.append(str(getattr(p, attr)))
        break
    else:
      parts.append(str(p))
  # nnx.State leaves sit under a Variable's `.value` attribute.
  return "/".join(x for x in parts if x != "value")


def param_shardings(params: nnx.State, mesh: Mesh, rules: Mapping[str, Any] = DEFAULT_RULES):
  """A pytree like `params` of NamedShardings, from the logical rules."""
  validate_rules(rules, mesh)

  def one(path, x):
    logical = param_logical_axes(_path_str(path), np.ndim(x))
    return NamedSharding(mesh, spec_for(np.shape(x), logical, mesh, rules))

  return jax.tree_util.tree_map_with_path(one, params)


def batch_sharding(mesh: Mesh, ndim: int, rows: int,
                   rules: Mapping[str, Any] = DEFAULT_RULES) -> NamedSharding:
  """`rows` rows over the batch axes (those that divide it), other dimensions replicated."""
  logical = ("batch",) + (None,) * (ndim - 1)
  return NamedSharding(mesh, spec_for((rows,) + (1,) * (ndim - 1), logical, mesh, rules))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def shard_like(tree, shardings):
  """Places every leaf of `tree` with the matching sharding.

  For a mesh that spans several processes, each process must hold the same
  full value; it contributes the shards of its own devices.
  """

  def put(x, sharding):
    if sharding.is_fully_addressable:
      return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return jax.device_put(x, sharding)  # already global: a reshard
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

  return jax.tree.map(put, tree, shardings)


def commit_to_one_device(tree):
  """Every leaf of `tree` as an array committed to one device: the one its
  committed leaves are on, else the default device.

  Arrays made by jax.numpy (an initialiser's, optax's zeros) are
  uncommitted, and a jitted function's outputs are committed when any of
  its inputs is: a function called first with a mix of the two and then
  with its own outputs compiles twice (the update's `apply` did, at the
  second step of a run whose warm start was loaded from a checkpoint).
  Without a mesh, the state a loop feeds back into a jitted function is
  committed up front. A tree already placed on several devices (a mesh)
  is returned as it is: jit places its uncommitted leaves along with it.
  """
  arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
  placed = {d for x in arrays if x.committed for d in x.sharding.device_set}
  if len(placed) > 1:
    return tree
  if placed:
    (device,) = placed
  else:
    default = jax.config.jax_default_device  # None, a device or a platform's name
    device = jax.devices(default)[0] if isinstance(default, str) else default or jax.local_devices()[0]
  return jax.device_put(tree, device)


def optimizer_shardings(opt_state, param_sh, mesh: Mesh):
  """Optimiser-state shardings: each moment follows its parameter, the rest is replicated.

  optax states hold copies of the parameter tree (Adam's mu and nu); a leaf
  whose path ends with a parameter's path takes that parameter's sharding.
  """
  by_path = {_path_str(p): sh for p, sh in jax.tree_util.tree_flatten_with_path(param_sh)[0]}

  def one(path, _):
    full = _path_str(path)
    for p, sh in by_path.items():
      if full == p or full.endswith("/" + p):
        return sh
    return replicated(mesh)

  return jax.tree_util.tree_map_with_path(one, opt_state)


def describe_layout(params: nnx.State) -> dict[str, str]:
  """{parameter path: its sharding spec} of placed parameters (for logs and tests)."""
  return {_path_str(p): str(x.sharding.spec) if hasattr(x.sharding, "spec") else str(x.sharding)
          for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
