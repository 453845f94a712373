"""The replay state and the algorithmic-lever transforms, each against an
independent computation: enumeration, hand-computed posteriors, a numerical
optimiser, or sampling frequencies."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import optimize

from jaxroll import config as config_lib
from jaxroll.replay import allocation, controls, filtering, registry, reuse, selection
from jaxroll.replay.protocol import chain, groups_from, identity, uniform_plan
from jaxroll.replay.state import init_replay, observe, push_groups, release_slots


def _groups(rewards, valid=None):
  r = np.asarray(rewards, np.float32)
  v = np.ones_like(r, bool) if valid is None else np.asarray(valid, bool)
  return groups_from(np.arange(r.shape[0]), r, v)


# -- the replay state ---------------------------------------------------------

def test_observe_matches_numpy_and_counts_degenerate_runs():
  replay = init_replay(5)
  r = np.array([[1, 1, 1, 1], [0, 1, 0, 1], [0, 0, 0, 0]], np.float32)
  v = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], bool)
  lengths = np.array([[4, 6, 8, 0], [1, 1, 1, 1], [2, 4, 0, 0]])
  replay = observe(replay, jnp.array([0, 2, 4]), r, v, lengths, 7)
  replay = observe(replay, jnp.array([0]), r[:1], v[:1], lengths[:1], 8)
  np.testing.assert_array_equal(replay.groups_Q, [2, 0, 1, 0, 1])
  np.testing.assert_allclose(replay.samples_Q, [6, 0, 4, 0, 2])
  np.testing.assert_allclose(replay.reward_sum_Q, [6, 0, 2, 0, 0])
  np.testing.assert_allclose(replay.last_mean_Q, [1, 0, 0.5, 0, 0])
  np.testing.assert_allclose(replay.last_var_Q, [0, 0, 0.25, 0, 0])
  np.testing.assert_array_equal(replay.degenerate_run_Q, [2, 0, 0, 0, 1])
  np.testing.assert_allclose(replay.last_length_Q, [6, 0, 1, 0, 3])
  np.testing.assert_array_equal(replay.last_step_Q, [8, -1, 7, -1, 7])


def test_buffer_keeps_the_highest_priority_groups_and_round_trips_through_orbax(tmp_path):
  import orbax.checkpoint as ocp

  replay = init_replay(10, buffer_groups=2, group_size=2, max_new_tokens=3)
  z = lambda *s: np.zeros(s, np.float32)
  buf = replay.buffer
  for step, (prompt, prio) in enumerate([(1, 0.5), (2, 0.1), (3, 0.3), (4, 0.05)]):
    buf = push_groups(buf, jnp.array([prompt]), jnp.array([prio]), step, z(1, 2), np.ones((1, 2), bool),
                      np.ones((1, 2), np.int32), np.ones((1, 2), np.int32),
                      np.full((1, 2, 3), prompt, np.int32), z(1, 2, 3),
                      np.full((1, 2, 3), step, np.int32))
  # 0.5 and 0.3 survive; 0.05 is below both and is not added.
  assert sorted(np.asarray(buf.prompt_C).tolist()) == [1, 3]
  replay = replay.replace(buffer=buf)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "replay", replay)
  ckpt.wait_until_finished()
  back = ckpt.restore(tmp_path / "replay", jax.tree.map(jnp.zeros_like, replay))
  for a, b in zip(jax.tree.leaves(replay), jax.tree.leaves(back)):
    np.testing.assert_array_equal(a, b)


# -- protocol -----------------------------------------------------------------

def _equal_trees(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_chain_with_identity_equals_the_transform_on_every_path_under_jit():
  # Key-free transforms on each of the four paths, so "equals" is exact:
  # vip plans, vigor extends, dapo selects, popo replaces.
  replay = init_replay(8, buffer_groups=4, group_size=8, max_new_tokens=2)
  buf = replay.buffer.replace(prompt_C=jnp.array([5, 6, 7, -1], jnp.int32),
                              step_C=jnp.zeros(4, jnp.int32),
                              priority_C=jnp.array([0.2, 0.1, 0.3, -jnp.inf], jnp.float32))
  replay = replay.replace(buffer=buf, step=jnp.int32(1),
                          reward_sum_Q=jnp.arange(8, dtype=jnp.float32),
                          samples_Q=jnp.full((8,), 8.0))
  t = chain(allocation.vip(budget=12, n_min=2, n_max=8),
            allocation.vigor(budget=12, probes=2, round_size=2, max_per_prompt=8),
            selection.drop_zero_variance_groups(), reuse.popo(max_age=4, decay=0.5))
  both = chain(identity(), t)
  key = jax.random.key(0)
  r = np.tile(np.array([0.0, 1.0], np.float32), (4, 4))
  r[1] = 1.0  # one degenerate group: dapo drops it, popo replaces it
  g = groups_from(jnp.arange(4), r, np.arange(8)[None] < np.array([[2], [3], [4], [8]]))
  p = uniform_plan(jnp.arange(4), 8)
  for method, x in (("plan", p), ("select", g), ("extend", g), ("replace", g)):
    a = jax.jit(getattr(t, method))(x, t.init(replay), replay, key)
    b = jax.jit(getattr(both, method))(x, both.init(replay), replay, key)
    _equal_trees(a[0], b[0])
    _equal_trees(a[1], b[1][1])  # chain's state is (identity's, t's)
  # Each path did something, so the equalities above are not vacuous.
  planned, _ = t.plan(p, t.init(replay), replay, key)
  assert int(planned.samples_K.sum()) == 4 * 2  # vigor's probes after vip's allocation
  selected, _ = t.select(g, t.init(replay), replay, key)
  np.testing.assert_array_equal(np.asarray(selected.weight_KxG).sum(axis=1) > 0, [True, False, True, True])
  extra, _ = t.extend(g, t.plan(p, t.init(replay), replay, key)[1], replay, key)
  assert int(np.asarray(extra).sum()) == 2
  slot, _ = t.replace(g, t.init(replay), replay, key)
  np.testing.assert_array_equal(np.asarray(slot) >= 0, [False, True, False, False])


# -- selection ----------------------------------------------------------------

def _variance(x):
  return float(np.var(np.asarray(x, np.float64)))


@pytest.mark.parametrize("seed", range(6))
def test_pods_finds_the_maximum_variance_subset_by_enumeration(seed):
  rng = np.random.default_rng(seed)
  n, m = int(rng.integers(4, 9)), None
  m = int(rng.integers(2, n))
  r = rng.choice([0.0, 0.25, 0.5, 1.0, 2.0], size=n)
  valid = np.ones(n, bool)
  if seed % 2:
    valid[rng.integers(0, n)] = False  # one missing trajectory
  take = np.asarray(selection.max_variance_subset(jnp.asarray(r, jnp.float32), jnp.asarray(valid), m))
  idx = np.flatnonzero(valid)
  best = max(_variance(r[list(s)]) for s in itertools.combinations(idx, min(m, len(idx))))
  assert take.sum() == min(m, len(idx)) and not take[~valid].any()
  assert _variance(r[take]) == pytest.approx(best, abs=1e-6)
  g, _ = jax.jit(selection.pods(m).select)(_groups([r], [valid]), (), None, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(g.weight_KxG[0]) > 0, take)


def test_dapo_filter_drops_exactly_the_zero_variance_groups():
  g, _ = selection.drop_zero_variance_groups().select(
      _groups([[1, 1, 1], [0, 1, 0], [0, 0, 0]]), (), None, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(g.weight_KxG).sum(axis=1), [0, 3, 0])


# -- allocation ---------------------------------------------------------------

def test_vigor_spends_the_budget_exactly_on_the_highest_variance_groups():
  rng = np.random.default_rng(0)
  K, G, probes, budget = 6, 10, 2, 17
  p_K = np.array([0.5, 0.1, 0.9, 0.0, 0.6, 0.3])
  valid = np.zeros((K, G), bool)
  valid[:, :probes] = True
  rewards = (rng.random((K, G)) < p_K[:, None]).astype(np.float32)
  remaining = budget
  while remaining:
    var = np.array([np.var(rewards[k][valid[k]]) for k in range(K)])
    extra = np.asarray(allocation.vigor_round(jnp.asarray(rewards), jnp.asarray(valid), remaining, 3, G))
    assert 0 < extra.sum() <= min(3, remaining)
    # Every recipient has at least the variance of every non-recipient with room.
    room = valid.sum(axis=1) < G
    assert var[extra > 0].min() >= var[room & (extra == 0)].max(initial=-1)
    for k in np.flatnonzero(extra):
      valid[k, valid[k].sum()] = True
    remaining -= int(extra.sum())
  assert valid.sum() == K * probes + budget


def _vip_objective(sigma, n):
  return float(np.sum(np.square(sigma) / np.asarray(n, float)))


@pytest.mark.parametrize("seed", range(4))
def test_vip_allocation_is_optimal_against_enumeration_and_a_numerical_optimiser(seed):
  rng = np.random.default_rng(seed)
  K, n_min, n_max = 4, 1, 6
  sigma = np.sqrt(rng.uniform(0.01, 0.25, size=K))
  budget = int(rng.integers(K * n_min + 1, K * n_max))
  n = np.asarray(allocation.vip_allocate(jnp.asarray(sigma), budget, n_min, n_max))
  assert n.sum() == budget and n.min() >= n_min and n.max() <= n_max
  best = min(_vip_objective(sigma, c) for c in itertools.product(range(n_min, n_max + 1), repeat=K)
             if sum(c) == budget)
  assert _vip_objective(sigma, n) == pytest.approx(best, rel=1e-6)
  # The continuous relaxation (SLSQP) is a lower bound the integer optimum sits just above.
  res = optimize.minimize(lambda x: _vip_objective(sigma, x), np.full(K, budget / K), method="SLSQP",
                          bounds=[(n_min, n_max)] * K,
                          constraints=[{"type": "eq", "fun": lambda x: x.sum() - budget}])
  assert res.success and res.fun <= _vip_objective(sigma, n) + 1e-9
  assert np.abs(n - res.x).max() < 1.0 + 1e-6
  with pytest.raises(ValueError, match="cannot be split"):
    allocation.vip_allocate(jnp.asarray(sigma), K * n_max + 1, n_min, n_max)


# -- filtering ----------------------------------------------------------------

def test_beta_posterior_update_by_hand():
  state = filtering.BetaState(jnp.array([1.0, 3.0, 2.0]), jnp.array([1.0, 1.0, 5.0]))
  new = filtering.beta_update(state, jnp.array([1, 2]), jnp.array([2.0, 0.0]), jnp.array([4.0, 0.0]),
                              decay=0.5, prior=(1.0, 1.0))
  # prompt 1: a = 0.5 * 3 + 0.5 * 1 + 2 = 4, b = 0.5 * 1 + 0.5 * 1 + 2 = 3; prompt 2 unobserved.
  np.testing.assert_allclose(new.alpha_Q, [1.0, 4.0, 2.0])
  np.testing.assert_allclose(new.beta_Q, [1.0, 3.0, 5.0])


def test_mopps_keeps_prompts_whose_sampled_rate_is_near_the_target():
  replay = init_replay(3)
  t = filtering.mopps(num_keep=1, decay=1.0)
  # Prompt 0 is nearly always solved, prompt 1 about half the time, prompt 2 never.
  state = filtering.BetaState(jnp.array([200.0, 100.0, 1.0]), jnp.array([1.0, 100.0, 200.0]))
  kept = [int(np.argmax(np.asarray(t.plan(uniform_plan(jnp.arange(3), 4), state, replay,
                                           jax.random.key(i))[0].samples_K))) for i in range(50)]
  assert kept == [1] * 50
  _, state = t.select(_groups([[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]]), state, replay, None)
  np.testing.assert_allclose(state.alpha_Q, [203.0, 100.0, 2.0])
  np.testing.assert_allclose(state.beta_Q, [2.0, 104.0, 203.0])


def test_kalman_update_by_hand_and_uncertainty_growing_while_unseen():
  mean, var = filtering.kalman_update(0.0, 1.0, 2.0, 3.0)
  assert float(mean) == pytest.approx(0.5) and float(var) == pytest.approx(0.75)  # gain 1/4
  y, r = filtering.empirical_logit(3.0, 4.0)
  assert float(y) == pytest.approx(np.log(0.7 / 0.3)) and float(r) == pytest.approx(1 / (5 * 0.7 * 0.3))
  t = filtering.kgps(num_keep=1, group_size=4, drift=0.5, prior_var=1.0)
  replay = init_replay(2)
  state = t.init(replay)
  _, state = t.select(groups_from(jnp.array([0]), jnp.array([[1.0, 1, 1, 0]]), jnp.ones((1, 4), bool)),
                      state, replay, None)
  expect_mean, expect_var = filtering.kalman_update(0.0, 1.0, float(y), float(r))
  assert float(state.mean_Q[0]) == pytest.approx(float(expect_mean))
  assert float(state.var_Q[0]) == pytest.approx(float(expect_var))
  for _ in range(3):  # steps 1, 2, 3 pass without prompt 0
    _, state = t.select(groups_from(jnp.array([1]), jnp.zeros((1, 4)), jnp.zeros((1, 4), bool)),
                        state, replay, None)
  # Planning step 4, four steps after the observation at step 0.
  grown = filtering.kalman_predict(state.var_Q[0], state.now - state.step_Q[0], 0.5)
  assert float(grown) == pytest.approx(float(expect_var) + 0.5 * 4)


def test_greso_skip_probability_exploration_floor_and_adaptation():
  t = filtering.greso(target=0.25, step=0.1, floor=0.05)
  replay = init_replay(3).replace(degenerate_run_Q=jnp.array([0, 2, 50]),
                                  last_mean_Q=jnp.array([0.5, 1.0, 0.0]))
  state = filtering.GresoState(jnp.float32(0.5), jnp.float32(0.9))
  plan = uniform_plan(jnp.arange(3), 4)
  draws = np.stack([np.asarray(t.plan(plan, state, replay, jax.random.key(i))[0].samples_K) == 0
                    for i in range(4000)])
  # Skip rates: never for z = 0; 1 - 0.5^2 = 0.75 (easy); capped at 1 - floor for z = 50 (hard).
  np.testing.assert_allclose(draws.mean(axis=0), [0.0, 0.75, 0.95], atol=0.03)
  # Three of four sampled groups were degenerate and solved: easy p_e falls, hard p_e rises.
  _, new = t.select(_groups([[1, 1], [1, 1], [1, 1], [0, 1]]), state, replay, None)
  assert float(new.explore_easy) == pytest.approx(0.4) and float(new.explore_hard) == pytest.approx(1.0)
  low = filtering.GresoState(jnp.float32(0.05), jnp.float32(0.05))
  _, new = t.select(_groups([[1, 1]]), low, replay, None)
  assert float(new.explore_easy) == pytest.approx(0.05)  # the floor holds


def test_vcrl_filters_low_variance_groups_and_replays_high_variance_prompts():
  t = filtering.vcrl(threshold=0.5, replay_slots=1)
  g, _ = t.select(_groups([[1, 0, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1]]), (), None, None)
  # Normalised variances 1.0, 0.75, 0.0.
  np.testing.assert_array_equal(np.asarray(g.weight_KxG).sum(axis=1), [4, 4, 0])
  replay = init_replay(6).replace(last_var_Q=jnp.array([0.0, 0.2, 0.25, 0.1, 0.0, 0.0]),
                                  last_step_Q=jnp.array([1, 1, 1, 1, -1, -1]))
  p, _ = t.plan(uniform_plan(jnp.array([0, 2, 5]), 4), (), replay, None)
  np.testing.assert_array_equal(p.prompt_K, [0, 2, 1])  # prompt 2 is already a candidate


# -- random controls ------------------------------------------------------------

@pytest.mark.parametrize("name", ["mopps", "greso"])
def test_random_control_skips_as_many_prompts_as_its_criterion(name):
  replay = init_replay(12).replace(degenerate_run_Q=jnp.arange(12) % 3,
                                   last_mean_Q=jnp.where(jnp.arange(12) % 2 == 0, 1.0, 0.0))
  t = {"mopps": filtering.mopps(num_keep=5), "greso": filtering.greso()}[name]
  c = controls.random_control(t)
  plan = uniform_plan(jnp.arange(12), 4)
  for i in range(20):
    key = jax.random.key(i)
    crit, _ = t.plan(plan, t.init(replay), replay, jax.random.split(key)[0])
    ctrl, _ = jax.jit(c.plan)(plan, c.init(replay), replay, key)
    assert int((ctrl.samples_K == 0).sum()) == int((crit.samples_K == 0).sum())


def test_random_control_drops_as_many_groups_and_trajectories_as_its_criterion():
  rng = np.random.default_rng(1)
  rewards = rng.choice([0.0, 1.0], size=(8, 6), p=[0.3, 0.7])
  rewards[0] = 1.0  # a degenerate group
  for t in (selection.drop_zero_variance_groups(), selection.pods(3)):
    c = controls.random_control(t)
    g = _groups(rewards)
    crit, _ = t.select(g, t.init(None), None, None)
    ctrl, _ = c.select(g, c.init(None), None, jax.random.key(3))
    w_t, w_c = np.asarray(crit.weight_KxG) > 0, np.asarray(ctrl.weight_KxG) > 0
    assert w_c.sum() == w_t.sum()
    assert (~w_c.any(axis=1)).sum() == (~w_t.any(axis=1)).sum()
    assert sorted(w_c.sum(axis=1)) == sorted(w_t.sum(axis=1))


def test_vip_transform_allocates_only_over_planned_prompts():
  replay = init_replay(4).replace(reward_sum_Q=jnp.array([5.0, 0.0, 1.0, 9.0]),
                                  samples_Q=jnp.array([10.0, 10.0, 10.0, 10.0]))
  t = allocation.vip(budget=12, n_min=1, n_max=8)
  plan = uniform_plan(jnp.arange(4), 4)._replace(samples_K=jnp.array([4, 0, 4, 4]))
  p, _ = jax.jit(t.plan)(plan, (), replay, jax.random.key(0))
  n = np.asarray(p.samples_K)
  assert n[1] == 0 and n.sum() == 12
  # The same as allocating directly over the three planned prompts.
  rate = (np.array([5.0, 1.0, 9.0]) + 1) / 12
  direct = np.asarray(allocation.vip_allocate(jnp.asarray(np.sqrt(rate * (1 - rate))), 12, 1, 8))
  np.testing.assert_array_equal(n[[0, 2, 3]], direct)


def test_vigor_transform_spends_its_budget_through_extend_rounds():
  t = allocation.vigor(budget=20, probes=2, round_size=3, max_per_prompt=8)
  replay = init_replay(5)
  plan = uniform_plan(jnp.arange(5), 4)._replace(samples_K=jnp.array([4, 4, 0, 4, 4]))
  p, state = t.plan(plan, t.init(replay), replay, None)
  np.testing.assert_array_equal(p.samples_K, [2, 2, 0, 2, 2])
  rng = np.random.default_rng(0)
  valid = np.zeros((5, 8), bool)
  valid[[0, 1, 3, 4], :2] = True
  rewards = rng.choice([0.0, 1.0], size=(5, 8)).astype(np.float32)
  rewards[0] = [1, 0, 1, 0, 1, 0, 1, 0]
  while True:
    extra, state = jax.jit(t.extend)(groups_from(jnp.arange(5), rewards, valid), state, replay, None)
    extra = np.asarray(extra)
    if not extra.any():
      break
    assert extra[2] == 0
    for k in np.flatnonzero(extra):
      valid[k, valid[k].sum()] = True
  assert valid.sum() == 20 and int(state.remaining) == 0


# -- POPO's replay -------------------------------------------------------------

def _buffer(rng, C=10, Q=6, G=4, L=3):
  """A buffer with random prompts (some repeated), steps, priorities and empty slots."""
  replay = init_replay(Q, buffer_groups=C, group_size=G, max_new_tokens=L)
  prompt = rng.integers(-1, Q, size=C)
  return replay.buffer.replace(prompt_C=jnp.asarray(prompt, jnp.int32),
                               step_C=jnp.asarray(rng.integers(0, 10, size=C), jnp.int32),
                               priority_C=jnp.asarray(np.where(prompt >= 0, rng.choice([0.1, 0.2, 0.25], size=C),
                                                               -np.inf), jnp.float32))


def _brute_force_scores(buf, step, exclude, max_age, decay):
  prompt, age = np.asarray(buf.prompt_C), step - np.asarray(buf.step_C)
  score = np.asarray(buf.priority_C, np.float64) * decay ** age
  ok = [prompt[c] >= 0 and 1 <= age[c] <= max_age and prompt[c] not in exclude for c in range(len(prompt))]
  out = np.full(len(prompt), -np.inf)
  for c in range(len(prompt)):
    rivals = [d for d in range(len(prompt)) if ok[d] and prompt[d] == prompt[c]]
    if ok[c] and c == min(rivals, key=lambda d: (-score[d], d)):
      out[c] = score[c]
  return out


@pytest.mark.parametrize("seed", range(6))
def test_popo_replay_scores_and_slot_assignment_match_brute_force(seed):
  rng = np.random.default_rng(seed)
  buf = _buffer(rng)
  exclude = rng.integers(0, 6, size=2)
  got = np.asarray(jax.jit(lambda b, s, e: reuse.replay_scores(b, s, e, max_age=4, decay=0.5))(
      buf, 10, jnp.asarray(exclude, jnp.int32)))
  want = _brute_force_scores(buf, 10, exclude.tolist(), 4, 0.5)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  replace = rng.random(7) < 0.6
  slots = np.asarray(reuse.assign_slots(jnp.asarray(replace), jnp.asarray(got)))
  best = sorted(np.flatnonzero(np.isfinite(want)), key=lambda c: (-want[c], c))
  expect = np.full(7, -1)
  for i, k in enumerate(np.flatnonzero(replace)[:len(best)]):
    expect[k] = best[i]
  np.testing.assert_array_equal(slots, expect)


def test_popo_replaces_degenerate_groups_and_its_control_replaces_as_many_at_random():
  rng = np.random.default_rng(3)
  Q = 20
  replay = init_replay(Q, buffer_groups=12, group_size=4, max_new_tokens=3)
  buf = replay.buffer.replace(prompt_C=jnp.arange(10, 22, dtype=jnp.int32) % Q,
                              step_C=jnp.asarray(rng.integers(3, 9, size=12), jnp.int32),
                              priority_C=jnp.asarray(rng.uniform(0.05, 0.25, size=12), jnp.float32))
  replay = replay.replace(buffer=buf, step=jnp.int32(9))
  rewards = rng.choice([0.0, 1.0], size=(6, 4)).astype(np.float32)
  rewards[[1, 4]] = [1.0, 1.0, 1.0, 1.0]
  rewards[2] = 0.0
  g = groups_from(np.arange(6), rewards, np.ones((6, 4), bool))
  t = reuse.popo(max_age=4, decay=0.5)
  slots, _ = jax.jit(t.replace)(g, t.init(replay), replay, jax.random.key(0))
  slots = np.asarray(slots)
  degenerate = np.ptp(rewards, axis=1) == 0
  assert (slots >= 0).tolist() == degenerate.tolist()
  scores = np.asarray(reuse.replay_scores(buf, 9, jnp.arange(6), max_age=4, decay=0.5))
  assert sorted(slots[degenerate]) == sorted(np.argsort(-scores)[:degenerate.sum()])
  c = reuse.popo(max_age=4, decay=0.5, random=True)
  picked = set()
  for i in range(30):
    ctrl, _ = jax.jit(c.replace)(g, c.init(replay), replay, jax.random.key(i))
    ctrl = np.asarray(ctrl)
    assert (ctrl >= 0).sum() == degenerate.sum()
    assert np.isfinite(scores[ctrl[ctrl >= 0]]).all()  # only eligible slots
    picked |= set(np.flatnonzero(ctrl >= 0).tolist())
  assert len(picked) > degenerate.sum()  # not always the degenerate groups


def test_release_empties_replayed_slots_and_a_chain_takes_one_replay_technique():
  replay = init_replay(5, buffer_groups=3, group_size=2, max_new_tokens=2)
  buf = replay.buffer.replace(prompt_C=jnp.array([1, 2, 3], jnp.int32), priority_C=jnp.ones(3))
  out = release_slots(buf, jnp.array([-1, 2], jnp.int32))
  np.testing.assert_array_equal(out.prompt_C, [1, 2, -1])
  assert np.isneginf(np.asarray(out.priority_C)[2])
  t = reuse.popo(max_age=2, decay=1.0)
  with pytest.raises(ValueError, match="at most one replay technique"):
    chain(t, t)
  with pytest.raises(ValueError, match="their own random control"):
    controls.random_control(t)
  with pytest.raises(ValueError, match="max_age must be >= 1"):
    reuse.popo(max_age=0, decay=0.5)


def _spent(transform, candidates, rng):
  """Rollouts one step spends: the plan's samples, then extend rounds until
  none is asked (the loop in jaxroll.loop.sampler), on random 0/1 rewards."""
  replay = init_replay(32)
  state = transform.init(replay)
  key = jax.random.key(int(rng.integers(1 << 30)))
  p, state = transform.plan(uniform_plan(jnp.arange(candidates), 8), state, replay, key)
  n = np.asarray(p.samples_K).copy()
  rewards = rng.choice([0.0, 1.0], size=(candidates, 16)).astype(np.float32)
  for rnd in range(64):
    g = groups_from(jnp.arange(candidates), rewards, np.arange(16)[None] < n[:, None])
    if transform.extend is None:
      break
    extra, state = transform.extend(g, state, replay, jax.random.fold_in(key, rnd))
    if not np.asarray(extra).any():
      break
    n = np.minimum(n + np.asarray(extra), 16)
  return int(n.sum())


@pytest.mark.parametrize("name", ["vigor", "vip"])
@pytest.mark.parametrize("budget", [24, 40, 64, 100])
def test_allocation_controls_spend_what_their_technique_spends(name, budget):
  cfg = config_lib.apply_overrides(config_lib.ExperimentConfig(), [
      "rollout.prompts_per_step=8", "rollout.group_size=8", f"algorithm.budget={budget}",
      f"algorithm.techniques={name}"])
  ctrl = config_lib.apply_overrides(cfg, [f"algorithm.techniques=random_{name}"])
  technique, control = registry.build(cfg), registry.build(ctrl)
  for seed in range(3):
    a = _spent(technique, 8, np.random.default_rng(seed))
    b = _spent(control, 8, np.random.default_rng(seed))
    assert a == b == budget, (a, b)
  # The control's choice differs from the technique's (it is random, not a copy).
  replay = init_replay(32).replace(reward_sum_Q=jnp.arange(32, dtype=jnp.float32) % 9,
                                   samples_Q=jnp.full((32,), 8.0))
  p = uniform_plan(jnp.arange(8), 8)
  if name == "vip":
    a = technique.plan(p, technique.init(replay), replay, jax.random.key(1))[0].samples_K
    b = control.plan(p, control.init(replay), replay, jax.random.key(1))[0].samples_K
    assert not np.array_equal(a, b)
