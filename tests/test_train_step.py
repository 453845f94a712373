"""The RL update on real rollouts: on-policy ratios, zero-advantage gradients, learning."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from small_models import small_config, small_model

from jaxroll.model import Transformer
from jaxroll.rl.advantages import group_advantages
from jaxroll.rl.policy_logp import next_token_logp
from jaxroll.rl.train_step import make_update, pack, rl_loss
from jaxroll.rollout import RolloutEngine, SamplingParams

SEQ = 24


def _rollout(sampling, seed=0, peaked=True):
  # Peaked distributions make sampling errors show; flat ones make a single
  # update's effect on log-probs show.
  model = small_model(seed) if peaked else Transformer(small_config(), rngs=nnx.Rngs(seed))
  graphdef, params = nnx.split(model)
  engine = RolloutEngine.for_model(model, num_slots=8, max_prompt_len=8, max_new_tokens=12,
                                   sampling=sampling, stop_token_ids=[3])
  prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
  traj = engine.rollout(engine.load(params), prompts, group_size=4, key=jax.random.key(seed))
  return graphdef, params, prompts, traj


def test_trainer_logp_equals_behaviour_logp_on_policy():
  """The trainer's log-probs of sampled tokens equal the sampler's (ratio 1)."""
  for sampling in (SamplingParams(1.0), SamplingParams(0.7, top_k=5), SamplingParams(1.3, top_p=0.8)):
    graphdef, params, prompts, traj = _rollout(sampling)
    batch = pack(prompts, traj, np.zeros(8, np.float32), SEQ)
    logp = next_token_logp(graphdef, params, jnp.asarray(batch.tokens_NxT), sampling)
    mask = batch.loss_mask_NxT[:, 1:]
    assert mask.sum() == traj.num_tokens
    np.testing.assert_allclose(np.asarray(logp)[mask], batch.behaviour_logp_NxT[:, 1:][mask],
                               atol=2e-5)


def test_pack_places_prompt_and_completion():
  _, _, prompts, traj = _rollout(SamplingParams())
  batch = pack(prompts, traj, np.arange(8, dtype=np.float32), SEQ)
  for n in range(8):
    p = prompts[n // 4]
    g = int(traj.length_N[n])
    assert batch.tokens_NxT[n, :len(p)].tolist() == p
    assert batch.tokens_NxT[n, len(p):len(p) + g].tolist() == traj.row(n)
    assert batch.loss_mask_NxT[n].sum() == g and not batch.tokens_NxT[n, len(p) + g:].any()


def test_zero_advantages_give_zero_gradient_and_no_update():
  sampling = SamplingParams()
  graphdef, params, prompts, traj = _rollout(sampling)
  adv, degenerate = group_advantages(np.ones(8, np.float32), 4, "grpo")
  assert bool(degenerate.all()) and not np.any(np.asarray(adv))
  batch = pack(prompts, traj, np.asarray(adv), SEQ)
  grads = jax.grad(lambda p: rl_loss(p, graphdef, batch, None, sampling=sampling, clip_low=0.2,
                                     clip_high=0.2, aggregation="token_mean", kl_coef=0.0)[0])(params)
  assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grads))
  tx = optax.adam(1e-2)
  before = jax.tree.map(np.asarray, params)
  update = make_update(graphdef, tx, sampling=sampling, minibatches=2, clip_low=0.2, clip_high=0.2,
                       aggregation="token_mean", kl_coef=0.0)
  new_params, _, stats = update(jax.tree.map(jnp.array, params), tx.init(params), batch, None)
  assert float(stats["grad_norm"]) == 0.0
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(new_params)):
    np.testing.assert_array_equal(a, np.asarray(b))


def test_update_raises_the_likelihood_of_rewarded_completions():
  """One group, the first two completions rewarded: their log-prob must rise."""
  sampling = SamplingParams()
  graphdef, params, prompts, traj = _rollout(sampling, seed=1, peaked=False)
  rewards = np.array([1, 1, 0, 0, 1, 0, 0, 0], np.float32)
  adv, _ = group_advantages(rewards, 4, "grpo")
  batch = pack(prompts, traj, np.asarray(adv), SEQ)
  tx = optax.sgd(0.05)
  seq_logp = lambda p: np.asarray(
      (next_token_logp(graphdef, p, jnp.asarray(batch.tokens_NxT), sampling)
       * batch.loss_mask_NxT[:, 1:]).sum(-1))
  before = seq_logp(params)
  ref = jax.tree.map(jnp.array, params)  # exercises the KL path with a frozen copy
  update = make_update(graphdef, tx, sampling=sampling, minibatches=1, clip_low=0.2, clip_high=0.2,
                       aggregation="seq_mean_token_mean", kl_coef=0.01)
  new_params, _, stats = update(jax.tree.map(jnp.array, params), tx.init(params), batch, ref)
  delta = seq_logp(new_params) - before
  assert float(stats["kl"]) == 0.0  # identical policies before the step
  assert delta[adv > 0].mean() > 0 > delta[adv < 0].mean()


def test_mismatch_is_tiny_for_a_float32_sampler_and_clearly_positive_for_bfloat16():
  """The update's mismatch metric on real rollouts: the same float32 weights
  sample and train (agreement to rounding), then a bfloat16 copy samples."""
  sampling = SamplingParams()
  model = Transformer(small_config(), rngs=nnx.Rngs(0))  # flat distributions: log-probs far from 0
  graphdef, params = nnx.split(model)
  engine = RolloutEngine.for_model(model, num_slots=8, max_prompt_len=8, max_new_tokens=12,
                                   sampling=sampling, stop_token_ids=[3])
  prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
  tx = optax.sgd(0.0)
  update = make_update(graphdef, tx, sampling=sampling, minibatches=1, clip_low=0.2, clip_high=0.2,
                       aggregation="token_mean", kl_coef=0.0, measure_mismatch=True)
  found = {}
  for dtype in (None, jnp.bfloat16):
    traj = engine.rollout(engine.load(params, version=3, dtype=dtype), prompts, group_size=4,
                          key=jax.random.key(0))
    assert (traj.version_NxL[traj.mask_NxL] == 3).all()
    batch = pack(prompts, traj, np.zeros(8, np.float32), SEQ, version=3)
    _, _, stats = update(jax.tree.map(jnp.array, params), tx.init(params), batch, None)
    found[dtype] = {k: float(v) for k, v in stats.items() if k.startswith("mismatch")}
  assert found[None]["mismatch_max"] < 1e-4
  assert found[jnp.bfloat16]["mismatch_abs_mean"] > 100 * max(found[None]["mismatch_abs_mean"], 1e-7)
  assert found[jnp.bfloat16]["mismatch_kl"] > 0
  # Tokens of another version are left out of the measure.
  batch = pack(prompts, traj, np.zeros(8, np.float32), SEQ, version=4)
  assert not batch.current_NxT.any()


def test_the_update_does_not_depend_on_the_padded_width():
  """A batch packed at its padded width (rl.train_step.padded_width) updates
  exactly as at the full sequence length: padding is masked everywhere."""
  from jaxroll.rl.train_step import padded_width

  sampling = SamplingParams()
  graphdef, params, prompts, traj = _rollout(sampling, seed=2, peaked=False)
  adv, _ = group_advantages(np.array([1, 0, 0, 1, 1, 1, 0, 0], np.float32), 4, "grpo")
  longest = max(len(prompts[n // 4]) + int(traj.length_N[n]) for n in range(8))
  width = padded_width(longest, 64, floor=8)
  assert longest <= width < 64
  tx = optax.sgd(0.05)  # Adam would magnify rounding in near-zero gradients
  out = []
  for w in (width, 64):
    batch = pack(prompts, traj, np.asarray(adv), w)
    update = make_update(graphdef, tx, sampling=sampling, minibatches=2, clip_low=0.2, clip_high=0.2,
                         aggregation="seq_mean_token_sum_norm", kl_coef=0.01, off_policy="tis",
                         measure_mismatch=True, max_len=63)
    ref = jax.tree.map(jnp.array, params)
    out.append(update(jax.tree.map(jnp.array, params), tx.init(params), batch, ref))
  for a, b in zip(jax.tree.leaves(out[0][0]), jax.tree.leaves(out[1][0])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  for k in out[0][2]:
    np.testing.assert_allclose(float(out[0][2][k]), float(out[1][2][k]), rtol=1e-4, atol=1e-6,
                               err_msg=k)
