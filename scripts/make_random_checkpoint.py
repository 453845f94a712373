"""Writes a random-weight Qwen2 Hugging Face checkpoint of a benchmark shape.

  python scripts/make_random_checkpoint.py --shape tiny --out DIR
  python scripts/make_random_checkpoint.py --shape qwen2.5-0.5b --out DIR

No download: the model is built from a config with transformers and saved
as safetensors, so jaxroll and transformers read the very same weights.
"""

import argparse

SHAPES = {
    # hidden 256, 4 layers, 4 heads, 2 KV heads, MLP 704, vocab 1024, tied.
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=704, vocab_size=1024,
                 tie_word_embeddings=True),
    # The Qwen2.5-0.5B architecture with random weights.
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                         tie_word_embeddings=True),
}


def make(shape: str, out: str, seed: int = 0) -> str:
  import torch
  import transformers

  torch.manual_seed(seed)
  cfg = transformers.Qwen2Config(max_position_embeddings=4096, rope_theta=1000000.0,
                                 rms_norm_eps=1e-6, **SHAPES[shape])
  transformers.Qwen2ForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
  return out


if __name__ == "__main__":
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
  ap.add_argument("--out", required=True)
  ap.add_argument("--seed", type=int, default=0)
  a = ap.parse_args()
  make(a.shape, a.out, a.seed)
