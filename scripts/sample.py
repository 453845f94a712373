"""Sample GRPO-style groups from a policy and report what the rollout did.

  python scripts/sample.py                      # the built-in tiny policy (random init)
  python scripts/sample.py --hf-checkpoint DIR --prompt "Question: 12 * 7 = ?" \
      --group-size 4 --max-new-tokens 64 --temperature 0.8

With a checkpoint folder (config.json, safetensors, tokenizer.json) the
completions are decoded and printed; without one, a small random-weight Qwen2
shape is built from its config, so the command works offline on any machine.
"""

import argparse
import json
import time

import jax
import numpy as np
from flax import nnx

from jaxroll.model import ModelConfig, Transformer
from jaxroll.model.hf_import import load_hf_model
from jaxroll.model.tokenizer import Tokenizer
from jaxroll.rollout import RolloutEngine, SamplingParams
from jaxroll.types import FINISH_NAMES

# The built-in policy: the tiny benchmark shape (Qwen2-style, tied embeddings).
TINY = ModelConfig(vocab_size=1024, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                   mlp_dim=704, qkv_bias=True, tie_embeddings=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--hf-checkpoint")
  ap.add_argument("--prompt", action="append", help="text prompt (repeatable; needs --hf-checkpoint)")
  ap.add_argument("--num-prompts", type=int, default=8, help="random prompts for the built-in policy")
  ap.add_argument("--group-size", type=int, default=8)
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--slots", type=int, default=16)
  ap.add_argument("--temperature", type=float, default=1.0)
  ap.add_argument("--top-k", type=int, default=0)
  ap.add_argument("--top-p", type=float, default=1.0)
  ap.add_argument("--seed", type=int, default=0)
  a = ap.parse_args()

  tokenizer, stop = None, []
  if a.hf_checkpoint:
    model = load_hf_model(a.hf_checkpoint)
    tokenizer = Tokenizer.from_folder(a.hf_checkpoint)
    stop = list(tokenizer.eos_token_ids)
    if not a.prompt:
      ap.error("--hf-checkpoint needs at least one --prompt")
    prompts = [tokenizer.encode(p) for p in a.prompt]
  else:
    if a.prompt:
      ap.error("text prompts need --hf-checkpoint (the built-in policy has no tokenizer)")
    model = Transformer(TINY, rngs=nnx.Rngs(a.seed))
    rng = np.random.default_rng(a.seed)
    prompts = [rng.integers(0, TINY.vocab_size, size=rng.integers(8, 33)).tolist()
               for _ in range(a.num_prompts)]
    stop = [0]  # token 0 plays end-of-sequence, so lengths vary
  engine = RolloutEngine.for_model(
      model, num_slots=a.slots, max_prompt_len=max(32, max(len(p) for p in prompts)),
      max_new_tokens=a.max_new_tokens, stop_token_ids=stop,
      sampling=SamplingParams(a.temperature, a.top_k, a.top_p))
  params = engine.load(model, version=0)
  t0 = time.perf_counter()
  traj = engine.rollout(params, prompts, group_size=a.group_size, key=jax.random.key(a.seed))
  seconds = time.perf_counter() - t0
  if tokenizer is not None:
    for n in range(len(traj.length_N)):
      print(f"--- prompt {traj.prompt_index_N[n]} sample {traj.sample_index_N[n]} "
            f"({FINISH_NAMES[int(traj.finish_N[n])]}, {traj.length_N[n]} tokens)")
      print(tokenizer.decode(traj.row(n)))
  stats = engine.last_stats
  print(json.dumps({
      "rows": int(len(traj.length_N)), "tokens": traj.num_tokens,
      "seconds_with_compile": round(seconds, 3),
      "mean_length": float(traj.length_N.mean()), "max_length": int(traj.length_N.max()),
      "finish": {FINISH_NAMES[k]: int((traj.finish_N == k).sum()) for k in (1, 2)},
      "decode_steps": stats.decode_steps, "generate_calls": stats.generate_calls,
      "prefill_calls": stats.prefill_calls, "slot_utilisation": round(stats.slot_utilisation, 3),
  }))


if __name__ == "__main__":
  main()
