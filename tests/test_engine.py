"""The rollout engine: KV-cache decoding, group sharing, continuous batching, errors."""

import jax
import numpy as np
import pytest

from jaxroll.rollout import RolloutEngine, SamplingParams
from jaxroll.types import FINISH_LENGTH, FINISH_STOP
from reference_sampling import chi_square_pvalue, filtered_distribution
from small_models import full_forward_logp, small_model



def _prompts(n, lo=1, hi=12, vocab=64, seed=0):
  r = np.random.default_rng(seed)
  return [r.integers(0, vocab, size=r.integers(lo, hi + 1)).tolist() for _ in range(n)]


def _engine(model, **kw):
  base = dict(num_slots=8, max_prompt_len=16, max_new_tokens=12)
  base.update(kw)
  return RolloutEngine.for_model(model, **base)


@pytest.mark.parametrize("sampling", [SamplingParams(1.0), SamplingParams(0.7, top_k=5, top_p=0.9)], ids=str)
def test_recorded_logp_equals_teacher_forced_distribution(sampling):
  """Decoding through the KV cache gives, token by token, the distribution of a
  full-sequence forward pass; the recorded behaviour log-prob is the filtered
  log-softmax at the sampled token."""
  model = small_model(1)
  engine = _engine(model, sampling=sampling)
  prompts = _prompts(5, seed=1)
  traj = engine.rollout(engine.load(model, version=3), prompts, group_size=2, key=jax.random.key(0))
  for n in range(10):
    prompt = prompts[n // 2]
    gen = traj.row(n)
    assert len(gen) == 12 and traj.finish_N[n] == FINISH_LENGTH
    logp_TxV = np.asarray(full_forward_logp(model, np.asarray([prompt + gen])))
    for i, tok in enumerate(gen):
      probs = filtered_distribution(logp_TxV[len(prompt) - 1 + i], sampling.temperature,
                                    sampling.top_k, sampling.top_p)
      assert probs[tok] > 0
      np.testing.assert_allclose(traj.logp_NxL[n, i], np.log(probs[tok]), atol=1e-4)
    np.testing.assert_array_equal(traj.position_NxL[n, :12], len(prompt) + np.arange(12))
    np.testing.assert_array_equal(traj.version_NxL[n, :12], 3)


def test_rope_table_gives_the_same_rollout_bit_for_bit():
  """The engine's table of rotary cos and sin (rows gathered by position)
  holds exactly the values the model computes per forward: tokens and
  log-probs agree bit for bit with decode weights that carry no table."""
  model = small_model(1)
  emb = model.embed.embedding
  emb[...] = emb[...] / 10.0  # spread distributions: a wrong rotation shows in every log-prob
  engine = _engine(model, sampling=SamplingParams(1.0), max_new_tokens=24)
  params = engine.load(model)
  assert params.rope_table is not None and params.rope_table[0].shape[0] == engine.cache_len
  prompts = _prompts(6, seed=3)
  with_table = engine.rollout(params, prompts, group_size=2, key=jax.random.key(5))
  without = engine.rollout(params.replace(rope_table=None), prompts, group_size=2, key=jax.random.key(5))
  np.testing.assert_array_equal(with_table.tokens_NxL, without.tokens_NxL)
  np.testing.assert_array_equal(with_table.logp_NxL, without.logp_NxL)
  assert np.ptp(with_table.logp_NxL[:, :24]) > 1.0  # not a near-deterministic model


def test_first_token_frequencies_match_model_softmax():
  """Thousands of samples of one prompt's next token, through the whole engine
  (group sharing and slot refills included), against softmax(logits / T)."""
  model = small_model(2)
  sampling = SamplingParams(temperature=0.8)
  engine = _engine(model, num_slots=256, max_new_tokens=1, sampling=sampling)
  prompt = [5, 17, 33, 2, 9]
  G = 6000
  traj = engine.rollout(engine.load(model), [prompt], group_size=G, key=jax.random.key(4))
  assert engine.last_stats.prefill_calls == 1  # one prefill serves the whole group
  probs = filtered_distribution(np.asarray(full_forward_logp(model, np.asarray([prompt])))[-1], 0.8)
  counts = np.bincount(traj.tokens_NxL[:, 0], minlength=64)
  assert chi_square_pvalue(counts, probs) > 1e-3


def test_greedy_group_sharing_equals_separate_prefills():
  model = small_model(3)
  engine = _engine(model, sampling=SamplingParams(temperature=0.0))
  params = engine.load(model)
  prompts = _prompts(3, seed=3)
  shared = engine.rollout(params, prompts, group_size=4, key=jax.random.key(0))
  separate = engine.rollout(params, [p for p in prompts for _ in range(4)], key=jax.random.key(1))
  np.testing.assert_array_equal(shared.tokens_NxL, separate.tokens_NxL)
  assert engine.last_stats.prompts_prefilled == 12
  # All samples of a greedy group are the same sequence.
  for p in range(3):
    assert len({tuple(shared.row(p * 4 + g)) for g in range(4)}) == 1


def test_continuous_batching_matches_one_row_at_a_time():
  model = small_model(4)
  prompts = _prompts(10, seed=4)
  keys = jax.random.split(jax.random.key(11), 10)
  # Stop on the model's most common mid-sequence token, so lengths vary.
  probe_engine = _engine(model)
  probe = probe_engine.rollout(probe_engine.load(model), prompts, row_keys=keys)
  stop = int(np.bincount(probe.tokens_NxL[:, 2:8].ravel(), minlength=64).argmax())
  engine = _engine(model, num_slots=3, stop_token_ids=[stop], refill_fraction=0.3)
  params = engine.load(model)
  together = engine.rollout(params, prompts, row_keys=keys)
  assert engine.last_stats.generate_calls > 1  # slots were refilled mid-run
  alone_engine = _engine(model, num_slots=1, stop_token_ids=[stop])
  lengths = set()
  for n, prompt in enumerate(prompts):
    alone = alone_engine.rollout(params, [prompt], row_keys=keys[n:n + 1])
    assert together.row(n) == alone.row(0)
    np.testing.assert_allclose(together.logp_NxL[n], alone.logp_NxL[0], atol=1e-5)
    lengths.add(int(together.length_N[n]))
    if together.finish_N[n] == FINISH_STOP:
      assert together.row(n)[-1] == stop and stop not in together.row(n)[:-1]
    else:
      assert together.finish_N[n] == FINISH_LENGTH and together.length_N[n] == 12
  assert len(lengths) > 1, "stop token never varied the lengths; pick another stop id"


def test_same_key_same_result_and_different_key_differs():
  model = small_model(5)
  engine = _engine(model, sampling=SamplingParams(temperature=3.0))
  params = engine.load(model)
  prompts = _prompts(4, seed=5)
  a = engine.rollout(params, prompts, group_size=2, key=jax.random.key(0))
  b = engine.rollout(params, prompts, group_size=2, key=jax.random.key(0))
  c = engine.rollout(params, prompts, group_size=2, key=jax.random.key(1))
  np.testing.assert_array_equal(a.tokens_NxL, b.tokens_NxL)
  assert (a.tokens_NxL != c.tokens_NxL).any()


def test_no_recompilation_in_steady_state():
  model = small_model(6)
  engine = _engine(model, num_slots=4, stop_token_ids=[3])
  params = engine.load(model)
  compiled = lambda: (engine._generate._cache_size(), engine._insert._cache_size(),
                      engine._prefill._cache_size())
  engine.rollout(params, _prompts(6, seed=6), group_size=2, key=jax.random.key(0))
  sizes = compiled()
  # An RL loop: same prompt count per step, new prompts, lengths, keys, groups.
  for step, G in enumerate([1, 3, 5]):
    engine.rollout(params, _prompts(6, seed=10 + step), group_size=G, key=jax.random.key(step))
  assert compiled() == sizes
  # Other prompt counts add at most one prefill shape per power of two <= slots.
  for n in range(1, 10):
    engine.rollout(params, _prompts(n, seed=20 + n), key=jax.random.key(n))
  assert compiled()[0] == 1 and compiled()[2] <= 3


def test_max_new_tokens_per_call():
  model = small_model(7)
  engine = _engine(model)
  traj = engine.rollout(engine.load(model), _prompts(2, seed=7), key=jax.random.key(0), max_new_tokens=5)
  np.testing.assert_array_equal(traj.length_N, 5)
  assert not traj.tokens_NxL[:, 5:].any() and not traj.logp_NxL[:, 5:].any()


@pytest.mark.parametrize("prompts,match", [
    ([[1] * 17], "17 tokens but the KV cache holds 16"),
    ([[1, 2], []], "prompt 1 is empty"),
    ([[1, 64]], "token id 64 outside the vocabulary"),
    ([[-1, 3]], "token id -1 outside"),
    ([], "no prompts"),
])
def test_bad_prompts_are_rejected_before_any_work(prompts, match):
  model = small_model(8)
  engine = _engine(model)
  with pytest.raises(ValueError, match=match):
    engine.rollout(engine.load(model), prompts, key=jax.random.key(0))
  assert engine.last_stats.prefill_calls == 0


def test_batch_larger_than_slots_is_rejected_by_insert():
  model = small_model(9)
  engine = _engine(model, num_slots=2)
  params = engine.load(model)
  prefix = engine.prefill(params, [[1, 2, 3]])
  with pytest.raises(ValueError, match="3 rows is larger than the engine's 2 slots"):
    engine.insert(engine.init_decode_state(), prefix, [0, 1, 2], [0, 0, 0],
                  jax.random.split(jax.random.key(0), 3))


def test_bad_call_arguments_are_rejected():
  model = small_model(9)
  engine = _engine(model)
  params = engine.load(model)
  with pytest.raises(ValueError, match="max_new_tokens=13"):
    engine.rollout(params, [[1]], key=jax.random.key(0), max_new_tokens=13)
  with pytest.raises(ValueError, match="group_size"):
    engine.rollout(params, [[1]], key=jax.random.key(0), group_size=0)
  with pytest.raises(ValueError, match="stop token id 99"):
    _engine(model, stop_token_ids=[99])


def test_low_level_operations_compose():
  """prefill -> insert -> generate step by step, as an external scheduler drives it."""
  model = small_model(10)
  engine = _engine(model, num_slots=4, sampling=SamplingParams(temperature=0.0))
  params = engine.load(model)
  prompt = [4, 8, 15, 16]
  prefix = engine.prefill(params, [prompt])
  state = engine.insert(engine.init_decode_state(), prefix, [2], [0], jax.random.split(jax.random.key(0), 1))
  tokens = []
  for _ in range(5):
    state, steps = engine.generate(params, state, max_steps=1)
    assert int(steps) == 1
    tokens.append(int(state.out_tokens_BxL[2, len(tokens)]))
  ref = engine.rollout(params, [prompt], key=jax.random.key(0), max_new_tokens=5)
  assert tokens == ref.row(0)
  assert not bool(state.active_B[0]) and bool(state.active_B[2])
