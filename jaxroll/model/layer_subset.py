"""A model made of a subset of another model's layers (Nested-ReFT, LayerSkip).

The sub-model keeps the embedding, final norm and head and runs only the
chosen blocks, in their order, sharing their weights (no copy: the state's
leaves are the same arrays). Its graph depends only on how many layers it
keeps, so every subset of one size decodes with one compiled engine.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from flax import nnx

from jaxroll.model.config import ModelConfig


def subset_config(cfg: ModelConfig, num_layers: int) -> ModelConfig:
  return dataclasses.replace(cfg, num_layers=num_layers)


def subset_graphdef(cfg: ModelConfig, num_layers: int):
  """The graph definition of a `num_layers`-layer model of `cfg`'s shape."""
  from jaxroll.model.transformer import Transformer

  abstract = nnx.eval_shape(lambda: Transformer(subset_config(cfg, num_layers), rngs=nnx.Rngs(0)))
  return nnx.split(abstract)[0]


def subset_state(state: nnx.State, layer_ids: Sequence[int]) -> nnx.State:
  """The full model's state with its blocks replaced by `layer_ids`' blocks, re-indexed 0..k-1."""
  layers = state["layers"]
  ids = [int(i) for i in layer_ids]
  if not ids or sorted(set(ids)) != ids or ids[0] < 0 or ids[-1] >= len(layers):
    raise ValueError(f"layer ids must be increasing, distinct and within [0, {len(layers)}), got {ids}")
  out = dict(state.items())
  out["layers"] = nnx.State({j: layers[i] for j, i in enumerate(ids)})
  return nnx.State(out)
