"""The policy model: a Llama/Qwen2-family decoder, its config and its importers."""

from jaxroll.model.config import ModelConfig
from jaxroll.model.transformer import Transformer

__all__ = ["ModelConfig", "Transformer"]
