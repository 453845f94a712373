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

from jaxroll import host_memory
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
  """Reads tensors one at a time and remembers which ones were used."""

  def __init__(self, folder: str):
    self.folder = folder
    self.files = _tensor_files(folder)
    self._opened: dict[str, safetensors_io.SafetensorsFile] = {}
    self.used: set[str] = set()

  def check(self, key: str, shape: tuple) -> safetensors_io.SafetensorsFile:
    """The file holding tensor `key`, once its shape is checked; marks it used."""
    if key not in self.files:
      raise CheckpointError(f"{self.folder}: tensor {key!r} is missing from the checkpoint")
    path = self.files[key]
    if path not in self._opened:
      self._opened[path] = safetensors_io.SafetensorsFile(path)
    f = self._opened[path]
    if key not in f.header:
      raise CheckpointError(f"{path}: tensor {key!r} is listed in the index but absent from the file")
    _, got = f.info(key)
    if got != tuple(shape):
      raise CheckpointError(f"{path}: tensor {key!r} has shape {got}, expected {tuple(shape)}")
    self.used.add(key)
    return f

  def get(self, key: str, shape: tuple) -> np.ndarray:
    """Tensor `key` as float32, read now (a fresh array the caller owns)."""
    arr = self.check(key, shape).read(key)
    return arr if arr.dtype == np.float32 else arr.astype(np.float32)

  def get_transposed(self, keys_and_shapes: list[tuple[str, tuple]]) -> np.ndarray:
    """The [out, in] tensors `keys_and_shapes`, stacked along out, as one
    [in, sum(out)] float32 array (a fused jaxroll kernel), filled one
    tensor at a time so that only one raw tensor is held beside it."""
    din = keys_and_shapes[0][1][1]
    out = np.empty((din, sum(s[0] for _, s in keys_and_shapes)), np.float32)
    col = 0
    for key, shape in keys_and_shapes:
      out[:, col:col + shape[0]] = self.get(key, shape).T
      col += shape[0]
    return out

  def unused(self) -> list[str]:
    return sorted(k for k in self.files
                  if k not in self.used and not k.endswith(_IGNORABLE_SUFFIXES))


# A tied model's embedding in decode weights: the engine embeds tokens from
# the [E, V] head's columns instead (jaxroll.rollout.decode_params), so the [V, E]
# table is not held twice. Zero rows keep the state's tree and rank.
def tied_embedding_placeholder(cfg: ModelConfig):
  return jnp.zeros((0, cfg.hidden_size), cfg.jnp_param_dtype)


def hf_params(source: _TensorSource, cfg: ModelConfig, *,
              head_only: bool = False) -> tuple[dict, Optional[jax.Array]]:
  """Builds jaxroll's parameter tree (a nested dict of device arrays in the
  config's param dtype), converting each tensor as it is read.

  Args:
    head_only: for a tied model, return the embedding as the [E, V] decode
      head and a placeholder in the tree (decode weights); otherwise the
      head is None and a tied embedding stays in the tree as [V, E].

  Returns:
    (params, head_ExV or None).
  """
  E, H, K, D, F, V = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                      cfg.mlp_dim, cfg.vocab_size)
  pdt = cfg.jnp_param_dtype
  # Each converted array goes to the device at once and its NumPy source is
  # dropped: the load holds the weights once, plus one tensor in flight.
  dev = lambda a: jnp.asarray(a, dtype=pdt)
  head_ExV, params = None, {}
  # The largest tensors first, while little else is resident.
  if cfg.tie_embeddings:
    if head_only:
      head_ExV = dev(source.get_transposed([("model.embed_tokens.weight", (V, E))]))
      params["embed"] = {"embedding": tied_embedding_placeholder(cfg)}
    if "lm_head.weight" in source.files:  # some exporters save the tied copy too
      source.check("lm_head.weight", (V, E))
  else:
    params["lm_head"] = {"kernel": dev(source.get_transposed([("lm_head.weight", (V, E))]))}
  if "embed" not in params:
    params["embed"] = {"embedding": dev(source.get("model.embed_tokens.weight", (V, E)))}
  layers = {}
  for i in range(cfg.num_layers):
    p = f"model.layers.{i}."
    get = lambda name, shape: dev(source.get(p + name, shape))
    # Hugging Face stores Linear weights [out, in]; jaxroll kernels are [in, out].
    fused = lambda *parts: dev(source.get_transposed([(p + n, s) for n, s in parts]))
    attn = {"qkv": {"kernel": fused(("self_attn.q_proj.weight", (H * D, E)),
                                    ("self_attn.k_proj.weight", (K * D, E)),
                                    ("self_attn.v_proj.weight", (K * D, E)))},
            "out": {"kernel": fused(("self_attn.o_proj.weight", (E, H * D)))}}
    if cfg.qkv_bias:
      attn["qkv"]["bias"] = dev(np.concatenate([source.get(p + "self_attn.q_proj.bias", (H * D,)),
                                                source.get(p + "self_attn.k_proj.bias", (K * D,)),
                                                source.get(p + "self_attn.v_proj.bias", (K * D,))]))
    layers[i] = {
        "attn_norm": {"scale": get("input_layernorm.weight", (E,))},
        "attn": attn,
        "mlp_norm": {"scale": get("post_attention_layernorm.weight", (E,))},
        "mlp": {"gate_up": {"kernel": fused(("mlp.gate_proj.weight", (F, E)), ("mlp.up_proj.weight", (F, E)))},
                "down": {"kernel": fused(("mlp.down_proj.weight", (E, F)))}},
    }
    host_memory.release()  # the layer's raw tensors
  params["layers"] = layers
  params["final_norm"] = {"scale": dev(source.get("model.norm.weight", (E,)))}
  return params, head_ExV


def _load(folder: str, param_dtype: Optional[str], dtype: Optional[str], head_only: bool):
  overrides = {k: v for k, v in (("param_dtype", param_dtype), ("dtype", dtype)) if v}
  cfg = load_hf_config(folder, **overrides)
  source = _TensorSource(folder)
  pure, head_ExV = hf_params(source, cfg, head_only=head_only)
  extra = source.unused()
  if extra:
    raise CheckpointError(
        f"{source.files[extra[0]]}: tensor {extra[0]!r} is not used by a {cfg.num_layers}-layer "
        f"jaxroll model ({len(extra)} unused tensors in all); refusing a partial load")
  # Build the module abstractly (no random init), then fill in the weights.
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  nnx.replace_by_pure_dict(state, pure)
  return cfg, graphdef, state, head_ExV


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
  _, graphdef, state, _ = _load(folder, param_dtype, dtype, head_only=False)
  return nnx.merge(graphdef, state)


def hf_decode_weight_shapes(folder: str, *, param_dtype: Optional[str] = None,
                            dtype: Optional[str] = None):
  """What `load_hf_decode_weights` returns, as shapes and dtypes only: only
  the folder's config is read. For compiling an engine before its weights
  are in memory (`RolloutEngine.compile_ahead`).

  Returns:
    (cfg, graphdef, state, head_ExV) with jax.ShapeDtypeStruct leaves.
  """
  overrides = {k: v for k, v in (("param_dtype", param_dtype), ("dtype", dtype)) if v}
  cfg = load_hf_config(folder, **overrides)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  head_ExV = None
  if cfg.tie_embeddings:  # as hf_params(head_only=True) lays them out
    placeholder = tied_embedding_placeholder(cfg)
    nnx.replace_by_pure_dict(state, {"embed": {"embedding": jax.ShapeDtypeStruct(
        placeholder.shape, placeholder.dtype)}})
    head_ExV = jax.ShapeDtypeStruct((cfg.hidden_size, cfg.vocab_size), cfg.jnp_param_dtype)
  return cfg, graphdef, state, head_ExV


def load_hf_decode_weights(folder: str, *, param_dtype: Optional[str] = None,
                           dtype: Optional[str] = None):
  """Loads a Hugging Face folder straight into the rollout engine's layout.

  For a tied model the embedding is read once, transposed into the [E, V]
  decode head, and the state holds a placeholder in its place (the engine
  embeds tokens from the head), so no [V, E] copy is ever resident.

  Returns:
    (cfg, graphdef, state, head_ExV): `RolloutEngine(cfg, graphdef, ...)`,
    then `engine.load(state, head_ExV=head_ExV)`. head_ExV is None for an
    untied model (its head is in the state).
  """
  return _load(folder, param_dtype, dtype, head_only=True)
