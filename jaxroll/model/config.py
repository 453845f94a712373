"""ModelConfig: one dataclass that describes a Llama/Qwen2-family decoder."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_ROPE_TYPES = ("default", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture and numerics of the policy.

  The fields follow Hugging Face's Llama/Qwen2 configs; `from_hf_dict` maps
  one onto the other. Qwen2 is `qkv_bias=True`; Llama is `qkv_bias=False`.

  Example:
    cfg = ModelConfig(vocab_size=1024, hidden_size=256, num_layers=4,
                      num_heads=4, num_kv_heads=2, mlp_dim=704)
  """

  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  mlp_dim: int
  head_dim: Optional[int] = None  # defaults to hidden_size // num_heads
  rope_theta: float = 10000.0
  # Llama 3 frequency scaling: (factor, low_freq_factor, high_freq_factor,
  # original_max_position_embeddings); None for plain RoPE.
  rope_llama3_scaling: Optional[tuple[float, float, float, int]] = None
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False
  tie_embeddings: bool = False
  max_position: int = 32768
  param_dtype: str = "float32"
  dtype: str = "float32"  # compute dtype of activations and matmuls

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                 "num_kv_heads", "mlp_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
          f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention")
    if self.head_dim is None:
      if self.hidden_size % self.num_heads:
        raise ValueError("hidden_size must be divisible by num_heads when head_dim is not set")
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}; expected one of {sorted(_DTYPES)}")

  @property
  def jnp_param_dtype(self):
    return _DTYPES[self.param_dtype]

  @property
  def jnp_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def qkv_dim(self) -> int:
    """Width of the fused q|k|v projection."""
    return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_hf_dict(cls, hf: dict, *, source: str = "config.json", **overrides) -> "ModelConfig":
    """Builds a ModelConfig from a Hugging Face `config.json` dictionary.

    Raises:
      ValueError: for an architecture or feature jaxroll does not implement,
        naming `source` and the offending key.
    """
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    model_type = hf.get("model_type")
    if arch not in ("LlamaForCausalLM", "Qwen2ForCausalLM") and model_type not in ("llama", "qwen2"):
      raise ValueError(
          f"{source}: unsupported architecture {arch or model_type!r}; jaxroll imports "
          "LlamaForCausalLM and Qwen2ForCausalLM")
    is_qwen2 = arch == "Qwen2ForCausalLM" or model_type == "qwen2"
    if hf.get("hidden_act", "silu") != "silu":
      raise ValueError(f"{source}: hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
    if hf.get("mlp_bias"):
      raise ValueError(f"{source}: mlp_bias=true is not supported")
    if is_qwen2 and hf.get("use_sliding_window"):
      raise ValueError(f"{source}: use_sliding_window=true is not supported")
    # transformers >= 5 writes `rope_parameters`; older files `rope_theta` plus
    # an optional `rope_scaling`.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
      raise ValueError(f"{source}: rope type {rope_type!r} is not supported; expected one of {_ROPE_TYPES}")
    llama3 = None
    if rope_type == "llama3":
      llama3 = (float(rope["factor"]), float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
    kwargs = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        mlp_dim=hf["intermediate_size"],
        head_dim=hf.get("head_dim"),
        rope_theta=float(theta),
        rope_llama3_scaling=llama3,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=True if is_qwen2 else bool(hf.get("attention_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position=int(hf.get("max_position_embeddings", 32768)),
    )
    kwargs.update(overrides)
    return cls(**kwargs)
