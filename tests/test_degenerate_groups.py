"""One definition of a degenerate group (all valid rewards equal), held by
every module: advantages, the DAPO filter, GRESO, VCRL, VIGOR, the replay
bookkeeping and POPO's replacement.

Equal non-dyadic rewards are the case that separates an exact test from a
floating-point variance test: eight rewards of 0.1 have a computed variance
of about 5.6e-17, not 0.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxroll.replay import allocation, filtering, reuse, selection
from jaxroll.replay.protocol import groups_from
from jaxroll.replay.state import group_moments, init_replay, observe
from jaxroll.rl.advantages import degenerate_groups, group_advantages

G = 8
# Rows: equal 0.1s (degenerate), equal 0.9s in the first 3 valid rows
# (degenerate), a real spread, equal 1s (degenerate).
R = np.array([[0.1] * G, [0.9, 0.9, 0.9, 0, 0, 0, 0, 0], [0, 0.1, 0, 0.1, 0, 0, 0, 0], [1.0] * G],
             np.float32)
V = np.array([[1] * G, [1, 1, 1, 0, 0, 0, 0, 0], [1] * G, [1] * G], bool)
DEGENERATE = [True, True, False, True]


def test_the_case_is_real_a_variance_test_calls_equal_rewards_informative():
  # The same moments without the predicate, as a variance test computes them.
  r, v = jnp.asarray(R), jnp.asarray(V, jnp.float32)
  n = v.sum(axis=1)
  mean = (r * v).sum(axis=1) / n
  var = np.asarray((((r - mean[:, None]) ** 2) * v).sum(axis=1) / n)
  assert var[0] > 0 and var[1] > 0  # floating-point residue, not signal


def test_the_predicate_against_python():
  expected = [len(set(r[v].tolist())) <= 1 or v.sum() < 2 for r, v in zip(R, V)]
  assert expected == DEGENERATE
  np.testing.assert_array_equal(degenerate_groups(R, V), DEGENERATE)
  np.testing.assert_array_equal(jax.jit(degenerate_groups)(R, V), DEGENERATE)
  # Fewer than two valid rows is degenerate whatever the reward.
  np.testing.assert_array_equal(degenerate_groups(np.array([[0.3, 9.0]]), np.array([[1, 0]])), [True])


def test_advantages_and_moments_agree():
  adv, degenerate = group_advantages(R.reshape(-1), G, valid_N=V.reshape(-1))
  np.testing.assert_array_equal(degenerate, DEGENERATE)
  assert not np.asarray(adv).reshape(4, G)[DEGENERATE].any()
  _, var, _ = group_moments(jnp.asarray(R), jnp.asarray(V))
  np.testing.assert_array_equal(np.asarray(var) == 0, DEGENERATE)


def test_every_transform_treats_them_as_degenerate():
  g = groups_from(jnp.arange(4), R, V)
  key = jax.random.key(0)
  dapo, _ = selection.drop_zero_variance_groups().select(g, (), None, key)
  np.testing.assert_array_equal(np.asarray(dapo.weight_KxG).sum(axis=1) > 0, np.logical_not(DEGENERATE))
  vcrl, _ = filtering.vcrl(threshold=1e-12).select(g, filtering.vcrl().init(init_replay(4)), None, key)
  np.testing.assert_array_equal(np.asarray(vcrl.weight_KxG).sum(axis=1) > 0, np.logical_not(DEGENERATE))
  # VIGOR gives a round's one rollout to the only group with signal.
  extra = allocation.vigor_round(jnp.asarray(R), jnp.asarray(V), 1, round_size=1, max_per_prompt=16)
  np.testing.assert_array_equal(extra, [0, 0, 1, 0])
  # GRESO, by hand: 2 of the 4 sampled groups are hard (mean < 1) and
  # degenerate, a rate of 0.5 above the target 0.25, so p_e(hard) steps down
  # from 1 to 0.99 (a variance test would see rate 0 and leave it at 1).
  greso = filtering.greso(target=0.25, step=0.01, floor=0.05)
  _, s1 = greso.select(g, greso.init(init_replay(4)), None, key)
  assert float(s1.explore_hard) == np.float32(0.99)
  replay = observe(init_replay(4), jnp.arange(4), jnp.asarray(R), jnp.asarray(V),
                   jnp.ones((4, G), jnp.int32), 0)
  np.testing.assert_array_equal(np.asarray(replay.degenerate_run_Q) > 0, DEGENERATE)


def test_popo_replaces_exactly_the_degenerate_groups():
  rng = np.random.default_rng(0)
  replay = init_replay(10, buffer_groups=6, group_size=G, max_new_tokens=2)
  # Six eligible buffer groups of prompts not in the batch, one step old.
  buf = replay.buffer.replace(prompt_C=jnp.arange(4, 10, dtype=jnp.int32),
                              step_C=jnp.zeros(6, jnp.int32),
                              priority_C=jnp.asarray(rng.uniform(0.1, 0.2, 6), jnp.float32))
  replay = replay.replace(buffer=buf, step=jnp.int32(1))
  t = reuse.popo(max_age=4, decay=0.5)
  slot, _ = t.replace(groups_from(jnp.arange(4), R, V), t.init(replay), replay, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(slot) >= 0, DEGENERATE)


def test_unanimous_groups_count_the_fresh_rows_of_each_group():
  from jaxroll.loop.step_metrics import _unanimous_groups

  rng = np.random.default_rng(0)
  r_N = rng.integers(0, 2, size=40).astype(np.float32)
  r_N[:8] = 0.0
  r_N[8:16] = 1.0
  rows_N = rng.random(40) < 0.7
  rows_N[32:] = False  # a group with no fresh rows is left out
  wrong, right = _unanimous_groups(r_N, rows_N, 8)
  expected = []
  for p in range(5):
    got = [r_N[p * 8 + g] for g in range(8) if rows_N[p * 8 + g]]
    if got:
      expected.append((all(x <= 0 for x in got), all(x >= 1 for x in got)))
  assert list(zip(wrong.tolist(), right.tolist())) == expected
  assert wrong[0] and right[1] and len(expected) == 4
