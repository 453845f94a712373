"""Behaviour policies other than the policy itself (jaxroll.behaviour).

Nested-ReFT: a layer subset samples with its own exact log-probs, and the
sequence-weighted gradient from its samples is the on-policy gradient in
expectation (checked against exact enumeration on a 6-token vocabulary).
R2PO: the rollout head never reaches evaluation, a zero head changes
nothing, and the head's state survives checkpoints and a SIGKILL.
"""

import functools
import json
import os
import signal
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxroll import config as config_lib
from jaxroll.behaviour.nested_reft import draw_layers, kept_layer_count
from jaxroll.behaviour.r2po import rarity_advantages, rollout_policy_kl
from jaxroll.model.layer_subset import subset_config, subset_graphdef, subset_state
from jaxroll.model.residual_head import init_residual_head
from jaxroll.rl.policy_logp import next_token_logp
from jaxroll.rl.train_step import RLBatch, rl_loss
from jaxroll.rollout import RolloutEngine, SamplingParams
from small_models import small_config, small_model
from test_training import ROOT, read, resume_from_step_4, tiny, train_once

# A tiny run whose groups are not all wrong, so rarity advantages are not all 0.
R2PO = ["behaviour.kind=r2po", "behaviour.head_learning_rate=0.01", "behaviour.head_init_std=0.05",
        "task.max_steps=2", "warm_start.steps=150", "warm_start.learning_rate=0.01", "report=false",
        "keep_checkpoints=10"]


def _moderate(model, scale=6.0):
  """small_model's embedding scaled by 40 leaves the layers little to do; 6
  keeps distributions peaked and the layers' effect visible."""
  emb = model.embed.embedding
  emb[...] = emb[...] / 40.0 * scale
  return model


def _metrics(run_dir):
  return [json.loads(x) for x in read(run_dir, "metrics.jsonl").splitlines()]


# -- layer subsets ------------------------------------------------------------


def test_subset_of_every_layer_is_the_model_and_a_proper_subset_is_not():
  model = _moderate(small_model(num_layers=3))
  graphdef, state = nnx.split(model)
  tokens = jnp.asarray([[3, 9, 27, 17, 5]], jnp.int32)
  positions = jnp.arange(5, dtype=jnp.int32)[None]
  full = model(tokens, positions)[0]
  every = nnx.merge(subset_graphdef(model.cfg, 3), subset_state(state, [0, 1, 2]))
  np.testing.assert_array_equal(np.asarray(every(tokens, positions)[0]), np.asarray(full))
  skip = nnx.merge(subset_graphdef(model.cfg, 2), subset_state(state, [0, 2]))
  assert np.abs(np.asarray(skip(tokens, positions)[0] - full)).max() > 1e-2
  with pytest.raises(ValueError, match="increasing"):
    subset_state(state, [2, 0])


def test_layer_draws_keep_the_ends_and_follow_seed_and_version():
  assert kept_layer_count(8, 0.5) == 4 and kept_layer_count(2, 0.1) == 1
  draws = {draw_layers(8, 4, True, seed=0, version=v) for v in range(30)}
  assert all(d[0] == 0 and d[-1] == 7 and len(d) == 4 for d in draws)
  assert len(draws) > 5  # re-drawn per version
  assert draw_layers(8, 4, True, 0, 3) == draw_layers(8, 4, True, 0, 3)
  assert draw_layers(2, 1, True, 0, 0) == (0,)


def test_nested_behaviour_logps_equal_the_skipped_models_teacher_forced_logps():
  model = _moderate(small_model(num_layers=3, vocab_size=64))
  graphdef, state = nnx.split(model)
  sub_graphdef, sub_state = subset_graphdef(model.cfg, 2), subset_state(state, [0, 2])
  sampling = SamplingParams(temperature=0.9, top_k=20)
  engine = RolloutEngine(subset_config(model.cfg, 2), sub_graphdef,
                         num_slots=8, max_prompt_len=8, max_new_tokens=10, sampling=sampling)
  prompts = [[1, 5, 9], [2, 4], [7, 7, 7, 3]]
  traj = engine.rollout(engine.load(sub_state), prompts, group_size=3, key=jax.random.key(4))
  full_differs = 0.0
  for n in range(len(traj.length_N)):
    prompt, g = prompts[n // 3], int(traj.length_N[n])
    row = jnp.asarray([prompt + traj.tokens_NxL[n, :g].tolist()], jnp.int32)
    sub = np.asarray(next_token_logp(sub_graphdef, sub_state, row, sampling))[0, len(prompt) - 1:]
    np.testing.assert_allclose(traj.logp_NxL[n, :g], sub, atol=2e-5)
    full = np.asarray(next_token_logp(graphdef, state, row, sampling))[0, len(prompt) - 1:]
    full_differs = max(full_differs, float(np.abs(full - sub).max()))
  assert full_differs > 1e-2  # the behaviour model is not the policy


# -- the importance-weighted gradient ------------------------------------------


def _flat(tree):
  return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


@functools.partial(jax.jit, static_argnames=("graphdef", "off_policy", "is_cap"))
def _grad_tree(state, graphdef, batch, prox, off_policy, is_cap):
  # Jitted: run eagerly, the gradient of a model dispatches op by op.
  loss = lambda s: rl_loss(s, graphdef, batch, None, prox, sampling=SamplingParams(), clip_low=0.2,
                           clip_high=0.2, aggregation="token_mean", kl_coef=0.0,
                           off_policy=off_policy, is_cap=is_cap)[0]
  return jax.grad(loss)(state)


def _grad(state, graphdef, batch, prox, off_policy, is_cap):
  return _flat(_grad_tree(state, graphdef, batch, prox, off_policy, is_cap))


_teacher_forced_logp = jax.jit(next_token_logp, static_argnames=("graphdef", "sampling"))


def _rows(prompt, ys):
  """RLBatch rows prompt + y for 2-token responses y."""
  N, p = len(ys), len(prompt)
  tokens = np.asarray([prompt + list(y) for y in ys], np.int32)
  mask = np.zeros_like(tokens, bool)
  mask[:, p:] = True
  return tokens, mask, N


@pytest.mark.slow
def test_sequence_weighted_gradient_from_skipped_layers_is_the_on_policy_gradient():
  """E_mu[w(y) grad L(y)] = E_pi[grad L(y)] for w = pi(y)/mu(y) (rl.off_policy=sis, uncapped).

  Exact on-policy gradient: enumeration of all 36 two-token responses.
  Estimate: 4096 responses sampled by the engine from the skipped model
  (layers 0 and 2 of 3), with the recorded behaviour log-probs, in 32
  batches; the batch means give a standard error. Tolerance: each of the
  projections on the exact gradient's direction and 3 random directions
  is within 4.5 standard errors. The same statistic rejects the
  uncorrected estimate (w = 1), so the test can fail.
  """
  model = _moderate(small_model(seed=1, vocab_size=6, num_layers=3, hidden_size=16, num_heads=2,
                               num_kv_heads=1, mlp_dim=32))
  graphdef, state = nnx.split(model)
  # Layer 1, the one skipped, scaled up so that skipping it matters: the
  # total variation between pi and mu over the 36 responses is about 0.36
  # and E_mu[w^2] about 2.2.
  layers = dict(state["layers"].items())
  layers[1] = jax.tree.map(lambda x: 3.0 * x, layers[1])
  state = nnx.State({**dict(state.items()), "layers": nnx.State(layers)})
  sub_graphdef, sub_state = subset_graphdef(model.cfg, 2), subset_state(state, [0, 2])
  prompt = [1, 4]
  reward = lambda y: 1.0 if y[0] == y[1] else (0.5 if y[1] == 3 else 0.0)
  sampling = SamplingParams()

  # Exact: sum over y of pi(y) * (per-row loss gradient at ratio 1).
  ys = [(a, b) for a in range(6) for b in range(6)]
  tokens, mask, N = _rows(prompt, ys)
  logp_pi = np.asarray(next_token_logp(graphdef, state, jnp.asarray(tokens), sampling))
  pi_y = np.exp(logp_pi[:, len(prompt) - 1:].sum(axis=1))
  assert abs(pi_y.sum() - 1.0) < 1e-4
  adv = np.asarray([reward(y) for y in ys], np.float32) - 0.3
  behaviour = np.zeros_like(tokens, np.float32)
  behaviour[:, 1:] = logp_pi
  # token_mean divides by the batch's 2N tokens: N * pi(y) makes each row's weight pi(y).
  exact = RLBatch(tokens, mask, behaviour, (N * pi_y * adv).astype(np.float32), mask)
  g_exact = _grad(state, graphdef, exact, None, "ppo", 2.0)

  engine = RolloutEngine(small_config(vocab_size=6, num_layers=2, hidden_size=16, num_heads=2,
                                      num_kv_heads=1, mlp_dim=32), sub_graphdef, num_slots=256,
                         max_prompt_len=4, max_new_tokens=2, sampling=sampling,
                         live_rows=False)  # every row decodes both steps: one program, not five
  dparams = engine.load(sub_state)
  rng = np.random.default_rng(0)
  dirs = [g_exact / np.linalg.norm(g_exact)] + [d / np.linalg.norm(d) for d in
                                                rng.normal(size=(3, g_exact.size))]
  proj = {"sis": [], "uncorrected": []}
  for b in range(32):
    traj = engine.rollout(dparams, [prompt], group_size=128, key=jax.random.key(100 + b))
    assert (traj.length_N == 2).all()
    tokens, mask, n = _rows(prompt, [tuple(t) for t in traj.tokens_NxL[:, :2].tolist()])
    behaviour = np.zeros_like(tokens, np.float32)
    behaviour[:, len(prompt):] = traj.logp_NxL[:, :2]
    adv_n = np.asarray([reward(tuple(t)) for t in traj.tokens_NxL[:, :2].tolist()], np.float32) - 0.3
    batch = RLBatch(tokens, mask, behaviour, adv_n, mask)
    prox = _teacher_forced_logp(graphdef=graphdef, params=state, tokens_NxT=jnp.asarray(tokens),
                                sampling=sampling)
    g = _grad(state, graphdef, batch, prox, "sis", float("inf"))
    g0 = _grad(state, graphdef, batch, jnp.asarray(behaviour[:, 1:]), "sis", float("inf"))  # w = 1
    proj["sis"].append([g @ d for d in dirs])
    proj["uncorrected"].append([g0 @ d for d in dirs])
  ref = np.asarray([g_exact @ d for d in dirs])
  z = {k: (np.mean(v, axis=0) - ref) / (np.std(v, axis=0, ddof=1) / np.sqrt(len(v)))
       for k, v in proj.items()}
  assert np.all(np.abs(z["sis"]) < 4.5), z
  assert np.abs(z["uncorrected"]).max() > 6.0, z  # the check has the power to see the bias


def test_sequence_weights_are_the_product_of_token_weights():
  from jaxroll.rl.losses import decoupled_ppo_loss

  rng = np.random.default_rng(0)
  prox, beh = rng.normal(size=(3, 4)) * 0.3, rng.normal(size=(3, 4)) * 0.3
  mask = np.asarray([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], bool)
  _, stats = decoupled_ppo_loss(jnp.asarray(prox), jnp.asarray(prox), jnp.asarray(beh),
                                jnp.ones(3), jnp.asarray(mask), is_cap=1e9, level="sequence")
  w_N = np.exp(((prox - beh) * mask).sum(axis=1))
  expected = (w_N[:, None] * mask).sum() / mask.sum()  # token-weighted mean of the row weights
  np.testing.assert_allclose(float(stats["is_weight_mean"]), expected, rtol=1e-5)


# -- R2PO -----------------------------------------------------------------------


def test_rarity_advantages_match_a_direct_computation():
  r = np.asarray([1, 0, 0, 0, 1, 1, 0, 1, 0.5, 0.5, 0.5, 0.5], np.float32)
  valid = np.ones(12, bool)
  valid[7] = False
  got = rarity_advantages(r, 4, valid)
  for p in range(3):
    rows = [n for n in range(p * 4, p * 4 + 4) if valid[n]]
    vals = r[rows]
    score = np.asarray([1.0 / np.sum(vals == v) for v in vals])
    want = np.zeros(len(rows)) if np.all(score == score[0]) else (score - score.mean()) / (score.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(got[rows], want, rtol=1e-5)
  assert got[7] == 0.0 and np.all(got[8:] == 0.0)
  assert got[0] > 0 > got[1]  # the lone right answer is the rare one


def test_the_rollout_policy_kl_is_k3_and_never_negative():
  rng = np.random.default_rng(0)
  rollout = np.log(rng.dirichlet(np.ones(6), size=(3, 5)))  # [N, T, V]
  policy = np.log(rng.dirichlet(np.ones(6), size=(3, 5)))
  tokens = np.stack([[rng.choice(6, p=np.exp(rollout[n, t])) for t in range(5)] for n in range(3)])
  pick = lambda lp: np.take_along_axis(lp, tokens[..., None], -1)[..., 0]
  mask = np.ones((3, 5), np.float32)
  mask[2, 3:] = 0
  got = float(rollout_policy_kl(jnp.asarray(pick(rollout)), jnp.asarray(pick(policy)), jnp.asarray(mask)))
  r = np.exp(pick(policy) - pick(rollout))
  np.testing.assert_allclose(got, ((r - 1 - np.log(r)) * mask).sum() / mask.sum(), rtol=1e-5)
  # Tokens the policy likes more than the rollout: the plain mean of
  # log(rollout / policy) would be negative; the estimate is not.
  lo, hi = jnp.log(jnp.asarray([[0.1, 0.2]])), jnp.log(jnp.asarray([[0.3, 0.6]]))
  assert float(jnp.mean(lo - hi)) < 0 < float(rollout_policy_kl(lo, hi, jnp.ones((1, 2))))
  # Unbiased: over many draws from the rollout it averages to the exact KL.
  b, p = np.exp(rollout[0, 0]), np.exp(policy[0, 0])
  draws = rng.choice(6, size=200_000, p=b)
  est = float(rollout_policy_kl(jnp.log(jnp.asarray(b[draws]))[None], jnp.log(jnp.asarray(p[draws]))[None],
                                jnp.ones((1, draws.size))))
  exact = float(np.sum(b * np.log(b / p)))
  r = p[draws] / b[draws]
  se = np.std(r - 1 - np.log(r)) / np.sqrt(draws.size)
  assert abs(est - exact) < 4 * se, (est, exact, se)


def test_the_rollout_head_changes_sampling_but_not_the_recorded_policy_logps():
  model = _moderate(small_model(num_layers=2))
  graphdef, state = nnx.split(model)
  sampling = SamplingParams(temperature=1.0)
  engine = RolloutEngine(model.cfg, graphdef, num_slots=8, max_prompt_len=8, max_new_tokens=8,
                         sampling=sampling)
  prompts = [[1, 5, 9], [2, 4]]
  key = jax.random.key(3)
  plain = engine.rollout(engine.load(state), prompts, group_size=4, key=key)
  zero = jax.tree.map(jnp.zeros_like, init_residual_head(jax.random.key(0), 32, 64))
  with_zero = engine.rollout(engine.load(state, residual=zero), prompts, group_size=4, key=key)
  np.testing.assert_array_equal(with_zero.tokens_NxL, plain.tokens_NxL)
  np.testing.assert_array_equal(with_zero.logp_NxL, plain.logp_NxL)
  head = init_residual_head(jax.random.key(1), 32, 64, std=0.5)
  steered = engine.rollout(engine.load(state, residual=head), prompts, group_size=4, key=key)
  assert not np.array_equal(steered.tokens_NxL, plain.tokens_NxL)
  for n in range(len(steered.length_N)):  # recorded: the policy's own log-probs of the drawn tokens
    prompt, g = prompts[n // 4], int(steered.length_N[n])
    row = jnp.asarray([prompt + steered.tokens_NxL[n, :g].tolist()], jnp.int32)
    own = np.asarray(next_token_logp(graphdef, state, row, sampling))[0, len(prompt) - 1:]
    np.testing.assert_allclose(steered.logp_NxL[n, :g], own, atol=2e-5)


@pytest.fixture(scope="module")
def r2po_run(tmp_path_factory):
  return train_once(tmp_path_factory, "r2po", *R2PO)


def test_r2po_trains_its_head_and_evaluates_the_policy_alone(r2po_run, tmp_path):
  from jaxroll.train import Trainer

  steps = _metrics(r2po_run)[1:]
  assert sum(m["r2po_rarity_adv_abs_mean"] > 0 for m in steps) >= 2
  assert max(m["r2po_head_grad_norm"] for m in steps) > 0
  # The held-out evaluation at step 8 is the policy's alone: the same
  # weights loaded without any head give the same generations.
  from jaxroll.checkpoint import Checkpointer

  trainer = Trainer(tiny(str(tmp_path / "again"), *R2PO))
  ckpt = Checkpointer(os.path.join(r2po_run, "checkpoints"), 10)
  step, params, _, _, extra = ckpt.restore_latest(
      trainer.learner.params, trainer.learner.tx.init(trainer.learner.params),
      trainer.checkpoints.fingerprint, extra=trainer.checkpoints.extra(trainer.sampler.state()["arrays"]))
  ckpt.close()
  assert step == 8
  head = extra["behaviour"]["head"]
  assert float(jnp.abs(head["w2_ExV"]).max()) > 0.05  # trained away from its init scale
  trainer.learner.params, trainer.behaviour.head = params, head
  # The path the run takes: the sampler's weights (with the head), then the evaluation's.
  ran = trainer.evaluate(trainer.eval_params(trainer.learner.publish(8)[0], 8))
  ran_tokens = trainer.evaluate.last_traj.tokens_NxL
  logged = steps[-1]
  assert (ran["heldout_accuracy"], ran["heldout_tokens"]) == (logged["heldout_accuracy"],
                                                              logged["heldout_tokens"])
  trainer.evaluate(trainer.engines.train.load(params, version=8))
  np.testing.assert_array_equal(trainer.evaluate.last_traj.tokens_NxL, ran_tokens)
  trainer.evaluate(trainer.engines.train.load(params, version=8, residual=head))
  assert not np.array_equal(trainer.evaluate.last_traj.tokens_NxL, ran_tokens)  # the head would act


def test_a_zero_head_leaves_the_run_as_plain_grpo(tmp_path_factory):
  base = [o for o in R2PO if not o.startswith("behaviour.")]
  plain = train_once(tmp_path_factory, "plain", *base)
  zero = train_once(tmp_path_factory, "zero_head", *base, "behaviour.kind=r2po",
                    "behaviour.head_init_std=0")
  strip = lambda ms: [{k: v for k, v in m.items() if not k.startswith("r2po_")} for m in ms]
  assert strip(_metrics(zero)) == strip(_metrics(plain))
  assert read(zero, "lengths.jsonl") == read(plain, "lengths.jsonl")


@pytest.mark.slow
def test_r2po_resumes_byte_identical(r2po_run, tmp_path):
  run_dir = resume_from_step_4(r2po_run, tmp_path, *R2PO)
  assert read(run_dir, "metrics.jsonl") == read(r2po_run, "metrics.jsonl")


@pytest.mark.slow
def test_r2po_killed_mid_run_resumes_byte_identical(r2po_run, tmp_path):
  from test_run_lifecycle import cli_env, command, rerun_after_kill

  run_dir = str(tmp_path / "killed")
  cfg_path = tmp_path / "killed.json"
  cfg_path.write_text(json.dumps(config_lib.to_dict(tiny(run_dir, *R2PO))))
  cache = str(tmp_path / "jax_cache")
  killed = subprocess.run(command(cfg_path), cwd=ROOT, env=cli_env(cache, "step_done:5"),
                          capture_output=True, text=True, timeout=600)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  rerun_after_kill(run_dir, cfg_path, cache)
  assert read(run_dir, "metrics.jsonl") == read(r2po_run, "metrics.jsonl")
  assert read(run_dir, "lengths.jsonl") == read(r2po_run, "lengths.jsonl")
