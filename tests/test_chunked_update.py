"""The RL update over length chunks equals the update of the whole batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from small_models import small_config

from jaxroll.model import Transformer
from jaxroll.rl.advantages import group_advantages
from jaxroll.rl.buckets import length_chunks, padded_width
from jaxroll.rl.chunked_update import make_chunked_update
from jaxroll.rl.losses import aggregate, token_weights
from jaxroll.rl.train_step import make_update, pack
from jaxroll.rollout import RolloutEngine, SamplingParams


@pytest.mark.parametrize("how", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_token_weights_reproduce_the_aggregation_and_split_over_rows(how):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(9, 13)).astype(np.float32)
  mask = rng.random((9, 13)) < 0.6
  mask[4] = False  # a row with no loss tokens still counts as a sequence
  w = token_weights(mask, how, max_len=20)
  whole = float(aggregate(jnp.asarray(x), jnp.asarray(mask), how, max_len=20))
  # NumPy, from the definitions.
  m = mask.astype(np.float64)
  expected = {"token_mean": (x * m).sum() / m.sum(),
              "seq_mean_token_mean": np.mean((x * m).sum(1) / np.maximum(m.sum(1), 1)),
              "seq_mean_token_sum_norm": np.mean((x * m).sum(1) / 20)}[how]
  np.testing.assert_allclose(whole, expected, rtol=1e-5)
  np.testing.assert_allclose(float((x * w).sum()), expected, rtol=1e-5)
  parts = [float(aggregate(jnp.asarray(x[r]), jnp.asarray(mask[r]), how, 20, jnp.asarray(w[r])))
           for r in (slice(0, 2), slice(2, 7), slice(7, 9))]
  np.testing.assert_allclose(sum(parts), expected, rtol=1e-5)


def test_length_chunks_cover_every_row_once_longest_first_at_a_width_that_holds_it():
  rng = np.random.default_rng(1)
  lengths = rng.integers(1, 700, size=100)
  chunks = length_chunks(lengths.tolist(), 768, 2048, row_multiple=4)
  seen = np.concatenate([c.rows for c in chunks])
  assert sorted(seen.tolist()) == list(range(100))
  # Longest first, ties in index order.
  assert seen.tolist() == sorted(range(100), key=lambda i: (-lengths[i], i))
  for c in chunks[:-1]:
    assert len(c.rows) == c.num_rows  # only the last chunk has empty rows
  for c in chunks:
    assert c.width == padded_width(int(lengths[c.rows[0]]), 768)  # its longest row's width
    assert all(lengths[r] <= c.width for r in c.rows)
    assert c.num_rows % 4 == 0
    assert c.num_rows == -(-max(1, 2048 // c.width) // 4) * 4
  with pytest.raises(ValueError):
    length_chunks([70], 64, 4096)
  with pytest.raises(ValueError):
    length_chunks([5, 6, 7], 64, 4096, max_rows=2)


def test_length_chunks_meet_one_shape_per_width_whatever_the_row_count():
  # Forty batches of a varying number of long-tailed rows (as the update
  # meets them once rows of advantage 0 are dropped): one (rows, width)
  # shape per width, whatever the batch, so an update compiles once per width.
  rng = np.random.default_rng(2)
  shapes, widths = set(), set()
  for _ in range(40):
    n = int(rng.integers(1, 129))
    lengths = np.minimum(800, 30 + rng.lognormal(np.log(100), 0.8, size=n).astype(int))
    for c in length_chunks(lengths.tolist(), 800, 2048, max_rows=128):
      shapes.add((c.num_rows, c.width))
      widths.add(c.width)
  assert len(shapes) == len(widths) >= 4
  # A small batch is not padded past its own rows.
  (c,) = length_chunks([5, 9, 3], 64, 4096)
  assert c.rows.tolist() == [1, 0, 2] and c.num_rows == 3 and c.width == 32


def _long_rollout(seed=0):
  # A flat random policy whose stop token is likely: lengths 1..40.
  model = Transformer(small_config(), rngs=nnx.Rngs(seed))
  graphdef, params = nnx.split(model)
  engine = RolloutEngine.for_model(model, num_slots=16, max_prompt_len=8, max_new_tokens=40,
                                   sampling=SamplingParams(), stop_token_ids=[3, 4, 5, 6])
  prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [8, 9], [20, 21, 22, 23]]
  traj = engine.rollout(engine.load(params), prompts, group_size=4, key=jax.random.key(seed))
  lengths = np.array([len(prompts[n // 4]) + int(traj.length_N[n]) for n in range(16)])
  return graphdef, params, prompts, traj, lengths


@pytest.mark.parametrize("aggregation,off_policy,minibatches,kl_coef,reject", [
    # Every aggregation, objective, minibatch count, KL and rejection setting
    # at least once, in four updates.
    ("seq_mean_token_mean", "ppo", 1, 0.0, 0.25),
    ("seq_mean_token_mean", "decoupled", 2, 0.05, 0.0),
    ("seq_mean_token_sum_norm", "tis", 2, 0.05, 0.0),
    ("token_mean", "aipo", 2, 0.0, 0.0),
])
def test_the_chunked_update_equals_the_whole_batch_update(aggregation, off_policy, minibatches,
                                                           kl_coef, reject):
  sampling = SamplingParams()
  graphdef, params, prompts, traj, lengths = _long_rollout()
  widths = {padded_width(int(n), 48, floor=8) for n in lengths}
  assert len(widths) >= 3, lengths  # the chunks really differ in width
  r = np.random.default_rng(3).integers(0, 2, size=16).astype(np.float32)
  adv, _ = group_advantages(r, 4, "grpo")
  batch = pack(prompts, traj, np.asarray(adv), 48)
  if reject:  # three rows whose sampler log-probs are off by 0.5: rejected at 0.25
    off = np.zeros(batch.behaviour_logp_NxT.shape, np.float32)
    off[[1, 6, 11]] = 0.5
    batch = batch._replace(behaviour_logp_NxT=np.asarray(batch.behaviour_logp_NxT) + off)
  tx = optax.sgd(0.05)
  kw = dict(sampling=sampling, minibatches=minibatches, clip_low=0.2, clip_high=0.28,
            aggregation=aggregation, kl_coef=kl_coef, off_policy=off_policy, measure_mismatch=True,
            max_len=47, mismatch_reject=reject)
  ref = jax.tree.map(jnp.array, params) if kl_coef else None
  whole = make_update(graphdef, tx, **kw)(jax.tree.map(jnp.array, params), tx.init(params), batch, ref)
  chunked = make_chunked_update(graphdef, tx, microbatch_tokens=64, min_width=8, **kw)(
      jax.tree.map(jnp.array, params), tx.init(params), batch, ref, lengths)
  for a, b in zip(jax.tree.leaves(whole[0]), jax.tree.leaves(chunked[0])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  assert set(whole[2]) == set(chunked[2]) - {"gradient_rows"}
  assert chunked[2]["gradient_rows"] == 16  # every row: skip_zero_advantage is off
  if reject:
    assert float(whole[2]["mismatch_rejected_rows"]) == 3.0
  for k in whole[2]:
    np.testing.assert_allclose(float(chunked[2][k]), float(whole[2][k]), rtol=1e-4, atol=1e-6,
                               err_msg=k)


@pytest.mark.parametrize("aggregation,off_policy,minibatches,measure,reject", [
    ("token_mean", "ppo", 1, False, 0.0),
    # proximal log-probs of the rows run only, gathered across two plans
    ("seq_mean_token_sum_norm", "tis", 2, False, 0.0),
    # every row scored for the statistics and the rejection, fewer updated
    ("seq_mean_token_mean", "decoupled", 1, True, 0.25),
])
def test_skipping_zero_advantage_rows_gives_the_whole_batch_update(aggregation, off_policy,
                                                                    minibatches, measure, reject):
  graphdef, params, prompts, traj, lengths = _long_rollout()
  # Groups 0 and 2 degenerate (all right, all wrong), 1 and 3 informative.
  r = np.array([1, 1, 1, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 1, 1, 0], np.float32)
  adv, degenerate = group_advantages(r, 4, "grpo")
  assert np.asarray(degenerate).tolist() == [True, False, True, False]
  batch = pack(prompts, traj, np.asarray(adv), 48)
  if reject:  # rows 6 (informative) and 9 (degenerate) rejected at 0.25
    off = np.zeros(batch.behaviour_logp_NxT.shape, np.float32)
    off[[6, 9]] = 0.5
    batch = batch._replace(behaviour_logp_NxT=np.asarray(batch.behaviour_logp_NxT) + off)
  # SGD: the parameters differ by the gradients' difference (Adam would
  # blow the rounding of near-zero gradients up to the learning rate).
  tx = optax.sgd(0.05)
  kw = dict(sampling=SamplingParams(), minibatches=minibatches, clip_low=0.2, clip_high=0.28,
            aggregation=aggregation, kl_coef=0.0, off_policy=off_policy, measure_mismatch=measure,
            max_len=47, mismatch_reject=reject)
  whole = make_update(graphdef, tx, **kw)(jax.tree.map(jnp.array, params), tx.init(params), batch, None)
  skipped = make_chunked_update(graphdef, tx, microbatch_tokens=64, min_width=8, skip_zero_advantage=True,
                                **kw)(jax.tree.map(jnp.array, params), tx.init(params), batch, None, lengths)
  for a, b in zip(jax.tree.leaves(whole[0]), jax.tree.leaves(skipped[0])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  signal = (np.asarray(adv) != 0).sum() - (1 if reject else 0)
  assert skipped[2]["gradient_rows"] == signal == 7 if reject else 8
  for k in ("loss", "grad_norm") + (("mismatch_rejected_rows", "mismatch_abs_mean") if reject else ()):
    np.testing.assert_allclose(float(skipped[2][k]), float(whole[2][k]), rtol=1e-4, atol=1e-6, err_msg=k)


def test_a_batch_without_signal_still_steps_the_optimiser():
  graphdef, params, prompts, traj, lengths = _long_rollout()
  batch = pack(prompts, traj, np.zeros(16, np.float32), 48)
  # AdamW with weight decay: a step moves every weight, whatever the gradient.
  tx = optax.adamw(0.01, weight_decay=0.1)
  kw = dict(sampling=SamplingParams(), minibatches=2, clip_low=0.2, clip_high=0.2,
            aggregation="token_mean", kl_coef=0.0, measure_mismatch=False, max_len=47)
  whole = make_update(graphdef, tx, **kw)(jax.tree.map(jnp.array, params), tx.init(params), batch, None)
  skipped = make_chunked_update(graphdef, tx, microbatch_tokens=64, min_width=8, skip_zero_advantage=True,
                                **kw)(jax.tree.map(jnp.array, params), tx.init(params), batch, None, lengths)
  assert skipped[2]["gradient_rows"] == 2  # one row per minibatch, for a zero gradient
  assert skipped[2]["grad_norm"] == 0.0
  for a, b, p in zip(jax.tree.leaves(whole[0]), jax.tree.leaves(skipped[0]), jax.tree.leaves(params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert not np.array_equal(np.asarray(b), np.asarray(p)) or not np.any(np.asarray(p))


def test_state_placed_for_the_loop_compiles_the_optimiser_step_once():
  # optax's fresh state is uncommitted while the parameters it starts from
  # are committed (a warm start's or a checkpoint's), and an update's
  # outputs are committed: unplaced, the second step compiled `apply` again.
  import logging

  from jaxroll.config import ExperimentConfig
  from jaxroll.loop.placement import Placement

  graphdef, params, prompts, traj, lengths = _long_rollout()
  r = np.random.default_rng(4).integers(0, 2, size=16).astype(np.float32)
  batch = pack(prompts, traj, np.asarray(group_advantages(r, 4, "grpo")[0]), 48)
  tx = optax.adamw(0.01)
  update = make_chunked_update(graphdef, tx, sampling=SamplingParams(), minibatches=1, clip_low=0.2,
                               clip_high=0.2, aggregation="token_mean", kl_coef=0.0, max_len=47,
                               microbatch_tokens=64, min_width=8)
  params = jax.device_put(params, jax.devices()[0])
  placed = Placement(ExperimentConfig()).place_state(params, tx.init(params))
  assert all(x.committed for x in jax.tree.leaves(placed))
  compiled = []

  class Log(logging.Handler):
    def emit(self, record):
      if record.getMessage().startswith("Finished XLA compilation of jit(apply)"):
        compiled.append(record.getMessage())

  handler, jax_log = Log(), logging.getLogger("jax")
  jax_log.addHandler(handler)
  jax.config.update("jax_log_compiles", True)
  try:
    state = placed
    for _ in range(3):
      p, o, _ = update(*state, batch, None, lengths)
      state = (p, o)
  finally:
    jax.config.update("jax_log_compiles", False)
    jax_log.removeHandler(handler)
  assert len(compiled) == 1, compiled
