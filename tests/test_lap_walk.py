"""The lap-walk task (long, long-tailed chains) and the micro-batched warm start
that trains on it, each against an independent computation."""

import math

import jax
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from jaxroll.tasks import lap_walk
from jaxroll.tasks.base import Example
from jaxroll.warm_start import _sft_loss, sft_batch

M = lap_walk.MODULUS


def simulate(p):
  """The reference response by brute force: step until the target has been hit `laps` times."""
  out, v, hits = [], p.start, 0
  while hits < p.laps:
    v = (v + p.step) % M
    out.append(str(v))
    if v == p.target:
      hits += 1
      out.append(f"#{p.laps - hits}")
  return out


def test_solution_and_length_match_a_simulation():
  for p in lap_walk.sample_problems(0, 300, max_laps=12, lap_median=3.0, lap_sigma=1.0):
    assert p.solution() == simulate(p)
    assert p.num_tokens == len(p.solution())
    assert lap_walk.parse_problem(p.prompt) == p
  p = lap_walk.Problem(5, 3, 2, 2)
  assert " ".join(p.solution()[:20]) == "8 11 14 17 0 3 6 9 12 15 18 1 4 7 10 13 16 19 2 #1"
  assert p.solution()[-2:] == ["2", "#0"] and p.num_tokens == 19 + 20 + 2


def test_lengths_are_long_tailed_and_laps_log_normal():
  ps = lap_walk.sample_problems(1, 4000, max_laps=64, lap_median=4.0, lap_sigma=0.9)
  laps = np.array([p.laps for p in ps], float)
  # Laps are a rounded log-normal: log-laps of the uncapped bulk have the configured centre.
  assert np.median(laps) == 4.0
  lengths = np.array([p.num_tokens for p in ps], float)
  cv = lengths.std() / lengths.mean()
  assert cv > 0.6 and np.percentile(lengths, 99) > 4 * np.median(lengths)
  capped = lap_walk.sample_problems(1, 500, max_laps=64, lap_median=4.0, lap_sigma=0.9, max_tokens=200)
  assert max(p.num_tokens for p in capped) <= 200


def test_splits_are_a_fixed_pool_disjoint_from_the_heldout_set():
  train, heldout = lap_walk.splits(0, 300, 50, max_laps=16, lap_median=3.0, lap_sigma=0.9,
                                   max_tokens=400)
  assert len(train) == 300 and len(heldout) == 50
  assert len({e.prompt for e in train}) == 300  # distinct: RL revisits each one
  assert not {e.prompt for e in train} & {e.prompt for e in heldout}
  assert all(e.difficulty == len(e.answer.split()) for e in train)


def test_warm_start_examples_are_fresh_short_problems_without_the_heldout_set():
  train, heldout = lap_walk.splits(0, 100, 50, max_laps=16, lap_median=4.0, lap_sigma=0.9,
                                   max_tokens=400)
  exclude = [e.prompt for e in heldout] + ["5 +3 =2 x1 ?"]
  warm = lap_walk.warm_start_examples(3, 2000, exclude, max_laps=16, lap_median=1.0, lap_sigma=0.9,
                                      max_tokens=400)
  assert len(warm) == 2000 and not {e.prompt for e in warm} & set(exclude)
  laps = np.array([lap_walk.parse_problem(e.prompt).laps for e in warm])
  assert np.median(laps) == 1 and laps.max() > 4  # short, with a tail that teaches the markers
  assert all(e.answer == " ".join(lap_walk.parse_problem(e.prompt).solution()) for e in warm)


def test_tokenizer_round_trips_every_word():
  tok = lap_walk.tokenizer(16)
  p = lap_walk.Problem(19, 7, 3, 16)
  text = p.prompt + " " + " ".join(p.solution())
  assert tok.decode(tok.encode(text)) == text


def test_rewards_chain_and_final():
  p = lap_walk.Problem(5, 3, 2, 2)
  answer = " ".join(p.solution())
  assert lap_walk.chain_reward(answer, answer) == 1.0
  slipped = answer.replace("14", "15", 1)
  assert lap_walk.chain_reward(slipped, answer) == 0.0
  assert lap_walk.final_reward(slipped, answer) == 1.0  # still ends "2 #0"
  assert lap_walk.final_reward(answer.rsplit(" ", 2)[0], answer) == 0.0  # stopped early
  assert lap_walk.chain_reward("", answer) == lap_walk.final_reward("", answer) == 0.0


def test_worked_solution_slips_at_the_configured_rate():
  """Per-value slip frequency against a binomial test (fixed seed)."""
  rng = np.random.default_rng(0)
  slips = values = 0
  for p in lap_walk.sample_problems(2, 200, max_laps=8, lap_median=2.0, lap_sigma=0.8):
    prev = p.start
    words = lap_walk.worked_solution(p, rng, 0.05).split()
    assert len(words) <= p.num_tokens
    for w in words:
      if w.startswith("#"):
        continue
      slips += int(w) != (prev + p.step) % M
      values += 1
      prev = int(w)
  assert values > 2000 and stats.binomtest(slips, values, 0.05).pvalue > 1e-3
  p = lap_walk.Problem(1, 9, 4, 5)
  assert lap_walk.worked_solution(p, rng, 0.0) == " ".join(p.solution())


def test_parse_problem_rejects_malformed_prompts():
  for bad in ["5 +3 =2 ?", "5 +3 =2 x0 ?", "5 +3 =2 3 ?", "25 +3 =2 x2 ?", "5 +0 =2 x2 ?"]:
    with pytest.raises(ValueError):
      lap_walk.parse_problem(bad)


def test_micro_batches_hold_every_row_and_add_up_to_the_batch_gradient():
  from small_models import small_config
  from jaxroll.model import Transformer

  tok = lap_walk.tokenizer(8)
  ps = lap_walk.sample_problems(3, 12, max_laps=8, lap_median=2.0, lap_sigma=1.0, max_tokens=250)
  examples = [Example(p.prompt, "", 0) for p in ps]
  solve = lambda prompt, rng, e: lap_walk.worked_solution(lap_walk.parse_problem(prompt), rng, e)
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
  grad = jax.grad(lambda p, t, m: _sft_loss(p, graphdef, t, m, total))
  summed = None
  for t, m in parts:
    g = grad(params, t, m)
    summed = g if summed is None else jax.tree.map(lambda a, b: a + b, summed, g)
  full = grad(params, whole, whole_mask)
  for a, b in zip(jax.tree.leaves(summed), jax.tree.leaves(full)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)
  assert math.isclose(float(total), float(whole_mask[:, 1:].sum()))
