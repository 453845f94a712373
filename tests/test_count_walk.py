"""The counted-walk task (long, long-tailed chains) and the micro-batched warm
start that trains on it, each against an independent computation."""

import math

import jax
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from jaxroll.tasks import count_walk
from jaxroll.tasks.base import Example
from jaxroll.warm_start import _sft_loss, sft_batch

M = count_walk.MODULUS
SHAPE = dict(median=48.0, sigma=0.8, max_tokens=767)


def simulate(p):
  """The reference response by brute force: add the prompt's difference, count down."""
  words = p.prompt.split()
  a, b, left = int(words[0]), int(words[2]), int(words[3][1:])
  out = []
  while left:
    a, b, left = b, (2 * b - a) % M, left - 1
    out += [str(b), f"#{left}"]
  return out


def test_solution_and_length_match_a_simulation():
  for p in count_walk.sample_problems(0, 300, **SHAPE):
    assert p.solution() == simulate(p)
    assert p.num_tokens == len(p.solution())
    assert count_walk.parse_problem(p.prompt) == p
  p = count_walk.Problem(5, 3, 6)
  assert p.prompt == "5 #7 8 #6"
  assert " ".join(p.solution()) == "11 #5 14 #4 17 #3 0 #2 3 #1 6 #0"


def test_lengths_are_long_tailed_and_steps_log_normal():
  ps = count_walk.sample_problems(1, 4000, median=48.0, sigma=0.8, max_tokens=100000)
  steps = np.array([p.steps for p in ps], float)
  # Uncapped, the log of the steps is normal around log(median) with shape sigma.
  assert abs(np.median(steps) - 48) <= 2
  assert stats.kstest((np.log(steps) - math.log(48)) / 0.8, "norm").pvalue > 1e-3
  lengths = np.array([p.num_tokens for p in ps], float)
  cv = lengths.std() / lengths.mean()
  assert cv > 0.6 and np.percentile(lengths, 99) > 4 * np.median(lengths)
  capped = count_walk.sample_problems(1, 500, **SHAPE)
  assert max(p.num_tokens for p in capped) <= 767 and count_walk.max_steps(767) == 383


def test_splits_are_a_fixed_pool_disjoint_from_the_heldout_set():
  train, heldout = count_walk.splits(0, 300, 50, **SHAPE)
  assert len(train) == 300 and len(heldout) == 50
  assert len({e.prompt for e in train}) == 300  # distinct: RL revisits each one
  assert not {e.prompt for e in train} & {e.prompt for e in heldout}
  assert all(e.difficulty == len(e.answer.split()) for e in train)


def test_warm_start_examples_are_fresh_problems_without_the_heldout_set():
  train, heldout = count_walk.splits(0, 100, 50, **SHAPE)
  exclude = [e.prompt for e in heldout] + ["5 #7 8 #6"]
  warm = count_walk.warm_start_examples(3, 2000, exclude, **{**SHAPE, "median": 8.0})
  assert len(warm) == 2000 and not {e.prompt for e in warm} & set(exclude)
  steps = np.array([count_walk.parse_problem(e.prompt).steps for e in warm])
  assert abs(np.median(steps) - 8) <= 1 and steps.max() > 40
  assert all(e.answer == " ".join(count_walk.parse_problem(e.prompt).solution()) for e in warm)


def test_tokenizer_round_trips_every_word():
  tok = count_walk.tokenizer(383)
  p = count_walk.Problem(19, 7, 383)
  text = p.prompt + " " + " ".join(p.solution())
  assert tok.decode(tok.encode(text)) == text


def test_rewards_chain_and_final():
  p = count_walk.Problem(5, 3, 6)
  answer = " ".join(p.solution())
  assert count_walk.chain_reward(answer, answer) == 1.0
  slipped = answer.replace("14", "15", 1)
  assert count_walk.chain_reward(slipped, answer) == 0.0
  assert count_walk.final_reward(slipped, answer) == 1.0  # still ends "6 #0"
  assert count_walk.final_reward(answer.rsplit(" ", 2)[0], answer) == 0.0  # stopped early
  assert count_walk.final_reward(answer + " 9 #0", answer) == 0.0  # walked too far
  assert count_walk.chain_reward("", answer) == count_walk.final_reward("", answer) == 0.0


def test_worked_solution_slips_at_the_configured_rate():
  """Per-value slip frequency against a binomial test (fixed seed)."""
  rng = np.random.default_rng(0)
  slips = values = 0
  for p in count_walk.sample_problems(2, 200, median=16.0, sigma=0.8, max_tokens=767):
    prev = count_walk.parse_problem(p.prompt).value(1)
    words = count_walk.worked_solution(p, rng, 0.05).split()
    assert words[1::2] == p.solution()[1::2]  # the counters never slip
    for w in words[::2]:
      slips += int(w) != (prev + p.step) % M
      values += 1
      prev = int(w)
  assert values > 2000 and stats.binomtest(slips, values, 0.05).pvalue > 1e-3
  p = count_walk.Problem(1, 9, 5)
  assert count_walk.worked_solution(p, rng, 0.0) == " ".join(p.solution())


def test_parse_problem_rejects_malformed_prompts():
  for bad in ["5 +3 =2 ?", "5 #7 8", "5 #8 8 #6", "25 #7 8 #6", "5 #2 5 #1", "5 #1 8 #0", "5 7 8 #6"]:
    with pytest.raises(ValueError):
      count_walk.parse_problem(bad)


def test_micro_batches_hold_every_row_and_add_up_to_the_batch_gradient():
  from small_models import small_config
  from jaxroll.model import Transformer

  tok = count_walk.tokenizer(125)
  ps = count_walk.sample_problems(3, 12, median=20.0, sigma=1.0, max_tokens=250)
  examples = [Example(p.prompt, "", 0) for p in ps]
  solve = lambda prompt, rng, e: count_walk.worked_solution(count_walk.parse_problem(prompt), rng, e)
  parts = sft_batch(examples, tok, np.random.default_rng(0), 0.0, 256, solve, microbatch_tokens=512)
  assert len(parts) > 1 and all(t.shape[0] * t.shape[1] <= max(512, t.shape[1]) for t, _ in parts)
  # Every example's row appears once: prompt + its worked solution + EOS.
  rng = np.random.default_rng(0)
  expected = [tok.encode(e.prompt) + tok.encode(solve(e.prompt, rng, 0.0), add_special_tokens=False)
              + [tok.eos_token_ids[0]] for e in examples]
  got = [list(r[r > 0]) for t, _ in parts for r in t if r.any()]
  assert sorted(map(tuple, got)) == sorted(map(tuple, expected))
  # The reference batch: every row in one [12, 256] array.
  whole = np.zeros((len(expected), 256), np.int32)
  whole_mask = np.zeros((len(expected), 256), bool)
  for i, (e, row) in enumerate(zip(examples, expected)):
    whole[i, :len(row)] = row
    whole_mask[i, len(tok.encode(e.prompt)):len(row)] = True
  # The summed micro-batch gradients equal the whole batch's gradient.
  cfg = small_config(vocab_size=tok.vocab_size, max_position=256)
  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  total = np.float32(sum(int(m[:, 1:].sum()) for _, m in parts))
  grad = jax.jit(jax.grad(lambda p, t, m: _sft_loss(p, graphdef, t, m, total)))
  summed = None
  for t, m in parts:
    g = grad(params, t, m)
    summed = g if summed is None else jax.tree.map(lambda a, b: a + b, summed, g)
  full = grad(params, whole, whole_mask)
  for a, b in zip(jax.tree.leaves(summed), jax.tree.leaves(full)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)
  assert math.isclose(float(total), float(whole_mask[:, 1:].sum()))
