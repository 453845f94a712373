"""Where a decode step's time goes, by jaxroll function (XLA:CPU).

  python scripts/profile_decode.py --hf-checkpoint DIR --batch B --prompt-len P \
      --new-tokens N [--dtype float32] [--top 30] [--seed 0]

A full batch of random prompts is prefilled and decoded to its end once to
compile, then once under jax's profiler. Every executed XLA thunk is
charged to each function on the stack that traced it
(jaxroll/rollout/step_profile.py), so a function's line is its inclusive
time per decode step: the model's Attention and MLP, the sampler, the
attention over the cache, the cache writes. Prints the table, then one
JSON line last: step_us (the thunks' time per step, a little above the
step's wall time: the profiler adds its own), decode_steps and functions
([name, us per step, share]).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxroll.model.hf_import import load_hf_decode_weights  # noqa: E402
from jaxroll.rollout import step_profile  # noqa: E402
from jaxroll.rollout.benchmark import add_decode_shape_args  # noqa: E402
from jaxroll.rollout.engine import RolloutEngine  # noqa: E402
from jaxroll.rollout.sampling import SamplingParams  # noqa: E402


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  add_decode_shape_args(ap)
  ap.add_argument("--top", type=int, default=30, help="functions printed (the JSON line has all)")
  a = ap.parse_args()
  if min(a.batch, a.prompt_len, a.new_tokens) < 1:
    ap.error("--batch, --prompt-len and --new-tokens must each be >= 1")
  if not os.path.isfile(os.path.join(a.hf_checkpoint, "config.json")):
    ap.error(f"--hf-checkpoint {a.hf_checkpoint} holds no config.json; "
             "make one with scripts/make_random_checkpoint.py")
  cfg, graphdef, state, head_ExV = load_hf_decode_weights(a.hf_checkpoint, param_dtype=a.dtype, dtype=a.dtype)
  engine = RolloutEngine(cfg, graphdef, num_slots=a.batch, max_prompt_len=a.prompt_len,
                         max_new_tokens=a.new_tokens, sampling=SamplingParams(temperature=1.0))
  params = engine.load(state, version=0, head_ExV=head_ExV)
  prompts = np.random.default_rng(a.seed).integers(0, cfg.vocab_size, size=(a.batch, a.prompt_len)).tolist()
  prefix = engine.prefill(params, prompts)
  keys = jax.random.split(jax.random.key(a.seed), a.batch)
  start = lambda: engine.insert(engine.init_decode_state(), prefix, list(range(a.batch)), list(range(a.batch)),
                                keys)
  steps = []

  def decode(state):
    state, n = jax.block_until_ready(engine.generate(params, state))
    steps.append(int(n))

  decode(start())  # compiles
  # The profiled run executes the decode loop alone (the insert's program
  # runs before it: its instructions' names could collide with the loop's).
  state = jax.block_until_ready(start())
  args = (params, state, engine.stop_ids, np.int32(a.new_tokens), np.int32(a.batch + 1))
  result = step_profile.profile(engine._generate, args, lambda: decode(state), units=1)
  n = steps[-1]
  functions = [(name, us / n, share) for name, us, share in result["functions"]]
  print(f"{'us/step':>9}  {'share':>6}  function (inclusive)")
  for name, us, share in functions[:a.top]:
    print(f"{us:9.1f}  {100 * share:5.1f}%  {name}")
  print(json.dumps({"step_us": result["total_us"] / n, "decode_steps": n, "batch": a.batch,
                    "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "dtype": a.dtype,
                    "functions": [[name, round(us, 2), round(share, 4)] for name, us, share in functions]}))


if __name__ == "__main__":
  main()
