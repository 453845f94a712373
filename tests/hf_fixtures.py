"""Small random-weight Hugging Face checkpoints built from configs (no download)."""

from __future__ import annotations

import os


def tiny_hf_config(arch: str, *, tie: bool = False, vocab: int = 97):
  import transformers

  common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=96, vocab_size=vocab,
                max_position_embeddings=256, rms_norm_eps=1e-6,
                tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
  if arch == "qwen2":
    return transformers.Qwen2Config(rope_theta=1000000.0, **common)
  if arch == "llama":
    return transformers.LlamaConfig(rope_theta=500000.0, **common)
  if arch == "llama3":  # Llama 3 rope scaling
    return transformers.LlamaConfig(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        rope_theta=500000.0, **common)
  raise ValueError(arch)


def save_random_hf_model(folder: str, arch: str, *, tie: bool = False, seed: int = 0,
                         max_shard_size=None, vocab: int = 97) -> str:
  """Saves a random-weight LlamaForCausalLM / Qwen2ForCausalLM to `folder`."""
  import torch
  import transformers

  torch.manual_seed(seed)
  cfg = tiny_hf_config(arch, tie=tie, vocab=vocab)
  cls = transformers.Qwen2ForCausalLM if arch == "qwen2" else transformers.LlamaForCausalLM
  model = cls(cfg).eval()
  # Random biases too, so a missing bias would show up in the logits.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("bias") or "norm" in name:
        p.add_(0.1 * torch.randn_like(p))
  kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
  model.save_pretrained(folder, safe_serialization=True, **kwargs)
  return folder


def load_torch_model(folder: str):
  import transformers

  return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="float32").eval()


def exists(folder: str) -> bool:
  return os.path.isfile(os.path.join(folder, "config.json"))
