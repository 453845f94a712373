"""Imports a Hugging Face Llama/Qwen2 folder into jaxroll parameters, offline.

A folder holds `config.json` and either `model.safetensors` or a sharded
`model.safetensors.index.json` with its shard files. Every jaxroll parameter
must be found and every tensor in the files must be used (rotary caches
aside), so a checkpoint either loads whole or fails with an error naming the
file and the key; there is no partial load.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxroll.errors import JaxrollError
from jaxroll.model import safetensors_io
from jaxroll.model.config import ModelConfig
from jaxroll.model.transformer import Transformer

# Tensors some exporters save that carry no learned weights.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(JaxrollError, ValueError):
  """A checkpoint folder that cannot be imported; the message names the file and key."""


def load_hf_config(folder: str, **overrides) -> ModelConfig:
  path = os.path.join(folder, "config.json")
  if not os.path.isfile(path):
    raise CheckpointError(f"{path}: missing; a Hugging Face model folder needs config.json")
  with open(path) as f:
    hf = json.load(f)
  try:
    return ModelConfig.from_hf_dict(hf, source=path, **overrides)
  except KeyError as e:
    raise CheckpointError(f"{path}: missing required key {e.args[0]!r}") from None


def _tensor_files(folder: str) -> dict[str, str]:
  """Maps every tensor name to the file that holds it."""
  index = os.path.join(folder, "model.safetensors.index.json")
  single = os.path.join(folder, "model.safetensors")
  if os.path.isfile(index):
    with open(index) as f:
      weight_map = json.load(f).get("weight_map")
    if not weight_map:
      raise CheckpointError(f"{index}: no 'weight_map'")
    for key, fname in weight_map.items():
      if not os.path.isfile(os.path.join(folder, fname)):
        raise CheckpointError(
            f"{os.path.join(folder, fname)}: shard listed in {index} (for key {key!r}) is missing")
    return {k: os.path.join(folder, v) for k, v in weight_map.items()}
  if os.path.isfile(single):
    header, _ = safetensors_io.read_header(single)
    return {k: single for k in header}
  raise CheckpointError(
      f"{folder}: no model.safetensors or model.safetensors.index.json "
      "(only safetensors checkpoints are supported)")


class _TensorSource:
  """Loads tensors on demand and remembers which ones were used."""

  def __init__(self, folder: str):
    self.folder = folder
    self.files = _tensor_files(folder)
    self._opened: dict[str, dict] = {}
    self.used: set[str] = set()

  def get(self, key: str, shape: tuple) -> np.ndarray:
    if key not in self.files:
      raise CheckpointError(f"{self.folder}: tensor {key!r} is missing from the checkpoint")
    path = self.files[key]
    if path not in self._opened:
      self._opened[path] = safetensors_io.load(path)
    tensors = self._opened[path]
    if key not in tensors:
      raise CheckpointError(f"{path}: tensor {key!r} is listed in the index but absent from the file")
    arr = tensors[key]
    if tuple(arr.shape) != tuple(shape):
      raise CheckpointError(f"{path}: tensor {key!r} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
    self.used.add(key)
    return arr

  def unused(self) -> list[str]:
    return sorted(k for k in self.files
                  if k not in self.used and not k.endswith(_IGNORABLE_SUFFIXES))


def hf_params(source: _TensorSource, cfg: ModelConfig) -> dict:
  """Builds jaxroll's parameter tree (a nested dict of NumPy arrays)."""
  E, H, K, D, F, V = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                      cfg.mlp_dim, cfg.vocab_size)
  f32 = lambda a: np.asarray(a, dtype=np.float32)
  layers = {}
  for i in range(cfg.num_layers):
    p = f"model.layers.{i}."
    get = lambda name, shape: f32(source.get(p + name, shape))
    # Hugging Face stores Linear weights [out, in]; jaxroll kernels are [in, out].
    qkv = np.concatenate([get("self_attn.q_proj.weight", (H * D, E)),
                          get("self_attn.k_proj.weight", (K * D, E)),
                          get("self_attn.v_proj.weight", (K * D, E))], axis=0).T
    attn = {"qkv": {"kernel": qkv}, "out": {"kernel": get("self_attn.o_proj.weight", (E, H * D)).T}}
    if cfg.qkv_bias:
      attn["qkv"]["bias"] = np.concatenate([get("self_attn.q_proj.bias", (H * D,)),
                                            get("self_attn.k_proj.bias", (K * D,)),
                                            get("self_attn.v_proj.bias", (K * D,))])
    gate_up = np.concatenate([get("mlp.gate_proj.weight", (F, E)),
                              get("mlp.up_proj.weight", (F, E))], axis=0).T
    layers[i] = {
        "attn_norm": {"scale": get("input_layernorm.weight", (E,))},
        "attn": attn,
        "mlp_norm": {"scale": get("post_attention_layernorm.weight", (E,))},
        "mlp": {"gate_up": {"kernel": gate_up}, "down": {"kernel": get("mlp.down_proj.weight", (E, F)).T}},
    }
  params = {
      "embed": {"embedding": f32(source.get("model.embed_tokens.weight", (V, E)))},
      "layers": layers,
      "final_norm": {"scale": f32(source.get("model.norm.weight", (E,)))},
  }
  if cfg.tie_embeddings:
    if "lm_head.weight" in source.files:  # some exporters save the tied copy too
      source.get("lm_head.weight", (V, E))
  else:
    params["lm_head"] = {"kernel": f32(source.get("lm_head.weight", (V, E))).T}
  return params


def load_hf_model(folder: str, *, param_dtype: Optional[str] = None,
                  dtype: Optional[str] = None) -> Transformer:
  """Loads a Hugging Face LlamaForCausalLM / Qwen2ForCausalLM folder.

  Args:
    folder: a local folder (no network access is attempted).
    param_dtype: dtype to store parameters in (default float32).
    dtype: compute dtype (default float32).

  Returns:
    A Transformer whose `.cfg` is the imported config.

  Raises:
    CheckpointError: unknown architecture, missing file, shard or tensor, a
      tensor of the wrong shape, or a tensor the model does not use.
  """
  overrides = {k: v for k, v in (("param_dtype", param_dtype), ("dtype", dtype)) if v}
  cfg = load_hf_config(folder, **overrides)
  source = _TensorSource(folder)
  pure = hf_params(source, cfg)
  extra = source.unused()
  if extra:
    raise CheckpointError(
        f"{source.files[extra[0]]}: tensor {extra[0]!r} is not used by a {cfg.num_layers}-layer "
        f"jaxroll model ({len(extra)} unused tensors in all); refusing a partial load")
  # Build the module abstractly (no random init), then fill in the weights.
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  pdt = cfg.jnp_param_dtype
  nnx.replace_by_pure_dict(state, jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype=pdt), pure))
  return nnx.merge(graphdef, state)
