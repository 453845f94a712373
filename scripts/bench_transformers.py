"""The reference point for bench_rollout.py: Hugging Face `generate` on PyTorch.

  python scripts/bench_transformers.py --hf-checkpoint DIR --batch B \
      --prompt-len P --new-tokens N [--dtype float32] [--seed 0]

Samples with do_sample=True, temperature 1.0, no top-k/top-p truncation and
min_new_tokens = max_new_tokens (every row generates exactly N tokens), after
one warm-up call. Prints one JSON line last, with the same keys as
bench_rollout.py.
"""

import argparse
import json
import resource
import time


def main():
  ap = argparse.ArgumentParser()
  # bench_rollout's arguments (jaxroll.rollout.benchmark.add_decode_shape_args),
  # spelled out: importing jaxroll would load jax into this process and add
  # its memory to the peak RSS this script reports for transformers.
  ap.add_argument("--hf-checkpoint", required=True)
  ap.add_argument("--batch", type=int, required=True)
  ap.add_argument("--prompt-len", type=int, required=True)
  ap.add_argument("--new-tokens", type=int, required=True)
  ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  ap.add_argument("--seed", type=int, default=0)
  a = ap.parse_args()
  import torch
  import transformers

  torch.manual_seed(a.seed)
  model = transformers.AutoModelForCausalLM.from_pretrained(a.hf_checkpoint, dtype=getattr(torch, a.dtype)).eval()
  vocab = model.config.vocab_size
  prompts = torch.randint(0, vocab, (a.batch, a.prompt_len))
  kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                attention_mask=torch.ones_like(prompts), pad_token_id=0)
  with torch.inference_mode():
    t0 = time.perf_counter()
    model.generate(prompts, **kwargs)
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(prompts, **kwargs)
    seconds = time.perf_counter() - t0
  tokens = (out.shape[1] - a.prompt_len) * a.batch
  print(json.dumps({
      "engine": "transformers",
      "tokens_per_s": tokens / seconds, "seconds": seconds, "compile_s": warm_s,
      "batch": a.batch, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "dtype": a.dtype,
      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
      "torch": torch.__version__, "transformers": transformers.__version__,
      "threads": torch.get_num_threads(),
  }))


if __name__ == "__main__":
  main()
