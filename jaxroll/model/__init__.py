"""The policy model: a Llama/Qwen2-family decoder, its config and its importers.

`ModelConfig` and `Transformer` load on first use, so that the file-level
modules here (safetensors_io, tokenizer) import without JAX.
"""

__all__ = ["ModelConfig", "Transformer"]


def __getattr__(name):
  if name == "ModelConfig":
    from jaxroll.model.config import ModelConfig

    return ModelConfig
  if name == "Transformer":
    from jaxroll.model.transformer import Transformer

    return Transformer
  raise AttributeError(f"module 'jaxroll.model' has no attribute {name!r}")
