"""Partial rollout in the engine: early stop at k complete groups, carry-over and
resume, and admission orders that only reorder."""

import jax
import numpy as np
import pytest

from jaxroll.rollout import RolloutEngine, decode
from jaxroll.scheduling.admission import FixedOrder, SiblingProbe, longest_first
from jaxroll.types import FINISH_LENGTH, FINISH_RUNNING
from flax import nnx

from jaxroll.model import Transformer
from small_models import small_config, small_model

G = 3


def _setup(num_slots=6, seed=0):
  # Moderately peaked logits and four stop tokens: lengths spread over 1..12.
  model = Transformer(small_config(), rngs=nnx.Rngs(seed))
  model.embed.embedding[...] *= 4.0
  r = np.random.default_rng(seed)
  prompts = [r.integers(0, 64, size=r.integers(2, 9)).tolist() for _ in range(5)]
  keys = jax.random.split(jax.random.key(seed), len(prompts) * G)
  engine = RolloutEngine.for_model(model, num_slots=num_slots, max_prompt_len=16,
                                   max_new_tokens=12, stop_token_ids=[0, 1, 2, 3])
  return model, engine, prompts, keys


def _assert_same_rows(a, b):
  np.testing.assert_array_equal(a.length_N, b.length_N)
  np.testing.assert_array_equal(a.finish_N, b.finish_N)
  np.testing.assert_array_equal(a.tokens_NxL, b.tokens_NxL)
  np.testing.assert_array_equal(a.position_NxL, b.position_NxL)
  np.testing.assert_allclose(a.logp_NxL, b.logp_NxL, atol=1e-5)


def test_stop_after_groups_returns_unfinished_rows_with_their_tokens():
  model, engine, prompts, keys = _setup(num_slots=16)
  params = engine.load(model)
  full = engine.rollout(params, prompts, group_size=G, row_keys=keys)
  part = engine.rollout(params, prompts, group_size=G, row_keys=keys, stop_after_groups=1)
  done = part.finish_N != FINISH_RUNNING
  complete = done.reshape(-1, G).all(axis=1)
  assert complete.sum() >= 1 and not done.all()
  assert len(set(full.length_N.tolist())) > 1
  # Finished rows are final; unfinished ones are a strict prefix of the full row.
  for n in range(len(prompts) * G):
    k = part.length_N[n]
    if done[n]:
      assert part.row(n) == full.row(n)
    else:
      assert k < full.length_N[n] and part.row(n) == full.row(n)[:k]
      np.testing.assert_allclose(part.logp_NxL[n, :k], full.logp_NxL[n, :k], atol=1e-5)
      assert not part.tokens_NxL[n, k:].any()
  # The decode stopped at the step the first group completed: its longest row.
  steps = engine.last_stats.finish_step_N
  assert engine.last_stats.decode_steps == full.length_N.reshape(-1, G).max(axis=1).min()
  np.testing.assert_array_equal(steps[done], part.length_N[done])  # all admitted at step 0
  assert (steps[~done] == -1).all()
  # Every row had a slot, so the loop itself stopped there: no return to the
  # host at each earlier finish.
  assert engine.last_stats.generate_calls == 1


def test_complete_groups_counts_labels_with_no_live_slot_by_brute_force():
  r = np.random.default_rng(0)
  B = 8
  for _ in range(50):
    group_B = r.integers(0, B + 1, size=B).astype(np.int32)  # B: a slot no group counts
    live_B = r.random(B) < 0.5
    want = sum(1 for g in set(group_B.tolist()) - {B} if not live_B[group_B == g].any())
    assert int(decode.complete_groups(jax.numpy.asarray(group_B), jax.numpy.asarray(live_B))) == want


@pytest.mark.parametrize("num_slots", [16, 4])
def test_resumed_rows_equal_uninterrupted_rows(num_slots):
  """Carried rows resumed under unchanged weights give the tokens, positions,
  versions and log-probs of a rollout that was never interrupted."""
  model, engine, prompts, keys = _setup(num_slots=num_slots, seed=0)
  params = engine.load(model, version=4)
  full = engine.rollout(params, prompts, group_size=G, row_keys=keys)
  part = None
  resumed_rows = 0
  for k in (1, 2, 3, 4):
    part = engine.rollout(params, prompts, group_size=G, row_keys=keys, carried=part,
                          stop_after_groups=k)
    resumed_rows += int(((part.length_N > 0) & (part.finish_N == FINISH_RUNNING)).sum())
  part = engine.rollout(params, prompts, group_size=G, row_keys=keys, carried=part)
  assert resumed_rows > 0
  _assert_same_rows(part, full)
  np.testing.assert_array_equal(part.version_NxL[part.mask_NxL], 4)


def test_resumed_rows_prefill_in_fixed_chunks_longest_first():
  """However many rows a step resumes, their prefill runs in chunks of a
  fixed row count (one compiled shape per length bucket), longest rows
  together, and the rows still equal an uninterrupted rollout."""
  model, engine, prompts, keys = _setup(num_slots=16, seed=0)
  params = engine.load(model)
  full = engine.rollout(params, prompts, group_size=G, row_keys=keys)
  part = engine.rollout(params, prompts, group_size=G, row_keys=keys, stop_after_groups=1)
  unfinished = np.flatnonzero(part.finish_N == FINISH_RUNNING).tolist()
  assert len(unfinished) > 8  # more than one chunk
  calls = []
  prefill = engine._prefill
  def recording(p, tokens, lengths):
    calls.append((tokens.shape, np.asarray(lengths)))
    return prefill(p, tokens, lengths)
  engine._prefill = recording
  # The last call admits every row, shortest first.
  for rows in (unfinished[:1], unfinished[:3], unfinished[:5], unfinished[::-1]):
    out = engine.rollout(params, prompts, group_size=G, row_keys=keys, carried=part,
                         admission=FixedOrder(rows))
    for n in rows:
      assert out.row(n) == full.row(n)
  # A resumed row is longer than any prompt (at most 8 tokens here).
  resumed = [(shape, lengths) for shape, lengths in calls if shape[1] > 16 or lengths.max() > 8]
  assert resumed and all(shape[0] == 8 for shape, _ in resumed)
  # Its chunks hold the longest rows first.
  last = [lengths[lengths > 1] for _, lengths in calls[-2:]]
  assert last[0].min() >= last[1].max()


def test_resumed_rows_keep_old_versions_and_logp_under_new_weights():
  model, engine, prompts, keys = _setup(num_slots=16, seed=0)
  old = engine.load(model, version=0)
  part = engine.rollout(old, prompts, group_size=G, row_keys=keys, stop_after_groups=1)
  other = small_model(99)  # "new weights"
  new = engine.load(other, version=1)
  out = engine.rollout(new, prompts, group_size=G, row_keys=keys, carried=part)
  assert (out.finish_N != FINISH_RUNNING).all()
  carried_rows = np.flatnonzero((part.finish_N == FINISH_RUNNING) & (part.length_N > 0))
  assert len(carried_rows)
  for n in carried_rows:
    c = part.length_N[n]
    np.testing.assert_array_equal(out.tokens_NxL[n, :c], part.tokens_NxL[n, :c])
    np.testing.assert_array_equal(out.logp_NxL[n, :c], part.logp_NxL[n, :c])
    np.testing.assert_array_equal(out.version_NxL[n, :c], 0)
    np.testing.assert_array_equal(out.version_NxL[n, c:out.length_N[n]], 1)
    # Positions continue without a gap.
    prompt_len = len(prompts[n // G])
    np.testing.assert_array_equal(out.position_NxL[n, :out.length_N[n]],
                                  prompt_len + np.arange(out.length_N[n]))


def test_carried_row_at_a_lower_limit_finishes_as_truncated():
  model, engine, prompts, keys = _setup(num_slots=16, seed=0)
  params = engine.load(model)
  part = engine.rollout(params, prompts, group_size=G, row_keys=keys, stop_after_groups=1)
  n = int(np.argmax((part.finish_N == FINISH_RUNNING) * part.length_N))
  c = int(part.length_N[n])
  assert c >= 1
  out = engine.rollout(params, prompts, group_size=G, row_keys=keys, carried=part, max_new_tokens=c)
  assert out.finish_N[n] == FINISH_LENGTH and out.length_N[n] == c


def test_admission_orders_only_reorder():
  """FIFO, LPT and sibling probing admit the same rows with the same keys: the
  trajectories are identical, only the slot schedule differs."""
  model, engine, prompts, keys = _setup(num_slots=4, seed=4)
  params = engine.load(model)
  N = len(prompts) * G
  fifo = engine.rollout(params, prompts, group_size=G, row_keys=keys)
  fifo_steps = engine.last_stats.decode_steps
  lpt = engine.rollout(params, prompts, group_size=G, row_keys=keys,
                       admission=longest_first(range(N), fifo.length_N))
  lpt_steps = engine.last_stats.decode_steps
  probe = engine.rollout(params, prompts, group_size=G, row_keys=keys,
                         admission=SiblingProbe(range(N), np.arange(N) // G, np.zeros(N)))
  _assert_same_rows(lpt, fifo)
  _assert_same_rows(probe, fifo)
  assert lpt_steps <= fifo_steps


def test_admission_must_cover_the_rows_to_decode():
  model, engine, prompts, keys = _setup()
  with pytest.raises(ValueError, match="cover exactly the rows"):
    engine.rollout(engine.load(model), prompts, group_size=G, row_keys=keys, admission=FixedOrder([0, 1]),
                   stop_after_groups=1)
  with pytest.raises(ValueError, match="cover exactly the rows"):
    engine.rollout(engine.load(model), prompts, group_size=G, row_keys=keys, admission=FixedOrder([0, 0]))


def test_an_admission_subset_decodes_only_those_rows():
  model, engine, prompts, keys = _setup(num_slots=4)
  params = engine.load(model)
  full = engine.rollout(params, prompts, group_size=G, row_keys=keys)
  part = engine.rollout(params, prompts, group_size=G, row_keys=keys, admission=FixedOrder([4, 0, 9]))
  for n in range(len(prompts) * G):
    if n in (0, 4, 9):
      assert part.row(n) == full.row(n) and part.finish_N[n] == full.finish_N[n]
    else:
      assert part.length_N[n] == 0 and part.finish_N[n] == FINISH_RUNNING
  with pytest.raises(ValueError, match="stop_after_groups=6"):
    engine.rollout(engine.load(model), prompts, group_size=G, row_keys=keys, stop_after_groups=6)


def test_sibling_probe_admits_probes_then_longest_probed_groups():
  rows = list(range(9))
  group = [0, 0, 0, 1, 1, 1, 2, 2, 2]
  adm = SiblingProbe(rows, group, fallback=[1, 1, 1, 5, 5, 5, 3, 3, 3])
  assert adm.take(3) == [3, 6, 0]  # one probe per group, longest fallback first
  adm.observe(6, 10)
  adm.observe(0, 2)
  assert adm.take(1) == [7]  # group 2's probe ran 10 tokens: its siblings first
  assert adm.take(2) == [8, 1]
  np.testing.assert_array_equal(adm.probe_predictions([1, 4, 7]), [2, np.nan, 10])
  # Group 1's probe is still running: its siblings fill free slots anyway.
  assert adm.take(5) == [2, 4, 5]
  assert len(adm) == 0


def test_interrupt_and_resume_keeps_each_tokens_version_and_behaviour_logp():
  """AReaL's interruptible rollout: decoding stops when new weights appear,
  and the unfinished rows continue under them. Under unchanged weights
  (version bumped) the rows equal an uninterrupted rollout; every token
  keeps the version that sampled it."""
  model, engine, prompts, keys = _setup(num_slots=16)
  full = engine.rollout(engine.load(model, version=0), prompts, group_size=G, row_keys=keys)
  calls = []
  part = engine.rollout(engine.load(model, version=0), prompts, group_size=G, row_keys=keys,
                        interrupt=lambda: calls.append(1) or len(calls) >= 2, interrupt_every=2)
  assert engine.last_stats.interrupted and engine.last_stats.decode_steps == 4
  cut = part.length_N.copy()
  assert (part.finish_N == FINISH_RUNNING).any()
  resumed = engine.rollout(engine.load(model, version=1), prompts, group_size=G, row_keys=keys,
                           carried=part)
  _assert_same_rows(resumed, full)
  for n in range(len(prompts) * G):
    k, length = cut[n], resumed.length_N[n]
    assert (resumed.version_NxL[n, :k] == 0).all() and (resumed.version_NxL[n, k:length] == 1).all()
    np.testing.assert_array_equal(resumed.logp_NxL[n, :k], part.logp_NxL[n, :k])
  assert (resumed.version_NxL[resumed.mask_NxL] == 1).any()


class _Feed:
  """Newer weights appear after the first check; `take` hands them over."""

  def __init__(self, params):
    self.params, self.checks, self.taken = params, 0, 0

  def changed(self):
    self.checks += 1
    return self.checks == 1

  def take(self):
    self.taken += 1
    return self.params


class _NoReward:
  rewards, num_errors, num_timeouts = (), 0, 0


def _score_nothing(rows, indices):
  r = _NoReward()
  r.rewards = [0.0] * len(rows)
  return r


def test_sampler_resumes_interrupted_rows_under_the_newer_weights():
  from jaxroll import config as config_lib
  from jaxroll.loop.sampler import Sampler

  model, engine, prompts, _ = _setup(num_slots=16)
  cfg = config_lib.apply_overrides(config_lib.ExperimentConfig(), [
      "rollout.prompts_per_step=5", f"rollout.group_size={G}", "rollout.max_new_tokens=12",
      "rollout.max_prompt_len=16", "pipeline.mode=interrupt",
      "pipeline.interrupt_every=2"])
  batches = iter([np.arange(5)] * 4)
  sr = Sampler(cfg, engine, prompts, list(range(5)), _score_nothing, batches, jax.random.key(0))
  feed = _Feed(engine.load(model, version=8))
  out = sr.run(engine.load(model, version=7), 7, feed=feed)
  assert feed.taken == 1 and out.metrics["rollout_interrupts"] == 1
  assert (out.traj.finish_N != FINISH_RUNNING).all() and len(out.indices) == 5
  versions = out.traj.version_NxL[out.traj.mask_NxL]
  assert set(versions.tolist()) == {7, 8}  # rows span the two versions
  # Version 7 tokens come first in every row: at most two decode steps of them.
  for n in range(len(out.traj.length_N)):
    v = out.traj.version_NxL[n, :out.traj.length_N[n]]
    assert (np.diff(v) >= 0).all() and (v == 7).sum() <= 2
  assert out.metrics["token_age_max"] == 0  # run() was asked for step 7; version 8 is newer
