"""Long-tail pieces on the host: truncation treatments and budgets, the group
pool, SortedRL's draw, and the schedule's config errors."""

import numpy as np
import pytest

from jaxroll import config as config_lib
from jaxroll.rl.advantages import group_advantages
from jaxroll.rl.train_step import pack
from jaxroll.rl.truncation import apply_truncation, budget_at, parse_budgets
from jaxroll.scheduling.group_pool import GroupPool
from jaxroll.scheduling.length_predictor import HistoryLengthPredictor
from jaxroll.loop.sampler import Sampler
from jaxroll.types import FINISH_LENGTH, FINISH_RUNNING, FINISH_STOP, Trajectories


def _traj(lengths, finish, L=6, version=None):
  N = len(lengths)
  lengths = np.asarray(lengths, np.int32)
  mask = np.arange(L)[None] < lengths[:, None]
  return Trajectories(
      prompt_index_N=np.arange(N) // 2, sample_index_N=np.arange(N) % 2,
      tokens_NxL=np.where(mask, 7, 0).astype(np.int32), logp_NxL=np.where(mask, -0.5, 0).astype(np.float32),
      position_NxL=np.where(mask, 3 + np.arange(L)[None], 0).astype(np.int32),
      version_NxL=np.zeros((N, L), np.int32) if version is None else np.asarray(version, np.int32),
      length_N=lengths, finish_N=np.asarray(finish, np.int32))


# -- truncation ---------------------------------------------------------------

def test_budget_curriculum_parses_and_rises():
  stages = parse_budgets("8@0,12@50,24@100", 24)
  assert [budget_at(stages, s) for s in (0, 49, 50, 99, 100, 500)] == [8, 8, 12, 12, 24, 24]
  assert parse_budgets("", 24) == [(0, 24)]


@pytest.mark.parametrize("text,match", [
    ("12@0,8@50", "decreases"), ("8@5", "step 0"), ("8@0,12@0", "increasing steps"),
    ("8@0,30@10", "outside"), ("8", "budget@step"), ("a@0", "budget@step")])
def test_bad_budget_curricula_are_rejected(text, match):
  with pytest.raises(ValueError, match=match):
    parse_budgets(text, 24)


def test_truncation_treatment_appears_in_the_loss_mask_and_advantages():
  """Two groups of two: rows 1 and 3 are truncated. Rewards [1, 1, 0, 1]."""
  r = np.array([1.0, 1.0, 0.0, 1.0])
  finish = [FINISH_STOP, FINISH_LENGTH, FINISH_STOP, FINISH_LENGTH]
  traj = _traj([2, 6, 3, 6], finish)
  truncated = traj.finish_N == FINISH_LENGTH
  prompts = [[1, 2, 3], [4, 5, 6]]
  masks = {}
  for treatment in ("keep", "zero_reward", "mask", "drop"):
    r2, in_group, in_loss = apply_truncation(r, truncated, treatment)
    adv, _ = group_advantages(r2, 2, "dr_grpo", valid_N=in_group)
    batch = pack(prompts, traj, np.asarray(adv), 12, np.repeat(in_loss[:, None], 6, axis=1))
    masks[treatment] = batch.loss_mask_NxT.sum(axis=1)
    if treatment == "keep":
      np.testing.assert_allclose(adv, [0, 0, -0.5, 0.5])
    if treatment == "zero_reward":
      np.testing.assert_allclose(adv, [0.5, -0.5, 0, 0])  # truncated rows now score 0
    if treatment == "mask":
      np.testing.assert_allclose(adv, [0, 0, -0.5, 0.5])  # baseline still sees them
    if treatment == "drop":
      np.testing.assert_allclose(adv, [0, 0, 0, 0])  # each group is left with one member
  np.testing.assert_array_equal(masks["keep"], [2, 6, 3, 6])
  np.testing.assert_array_equal(masks["zero_reward"], [2, 6, 3, 6])
  np.testing.assert_array_equal(masks["mask"], [2, 0, 3, 0])
  np.testing.assert_array_equal(masks["drop"], [2, 0, 3, 0])


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo"])
def test_advantages_over_valid_members_match_numpy(method):
  rng = np.random.default_rng(0)
  G = 5
  r = rng.random(4 * G).round(1)
  valid = rng.random(4 * G) > 0.3
  adv, degenerate = group_advantages(r, G, method, valid_N=valid)
  for p in range(4):
    sl = slice(p * G, (p + 1) * G)
    v = valid[sl]
    x = r[sl][v]
    k = len(x)
    expect = np.zeros(G)
    if k >= 2 and x.std() > 0:
      c = x - x.mean()
      expect[v] = {"grpo": c / (x.std(ddof=1) + 1e-6), "dr_grpo": c, "rloo": c * k / (k - 1)}[method]
    np.testing.assert_allclose(np.asarray(adv)[sl], expect, rtol=1e-5, atol=1e-6)
    assert bool(degenerate[p]) == (k < 2 or x.std() == 0)


def test_stale_token_mask_keeps_only_current_version_tokens():
  version = np.array([[3, 3, 4, 4, 0, 0], [4, 4, 4, 0, 0, 0]])
  traj = _traj([4, 3], [FINISH_STOP, FINISH_STOP], version=version)
  batch = pack([[1, 2]], traj, np.ones(2, np.float32), 10, traj.version_NxL == 4)
  np.testing.assert_array_equal(batch.loss_mask_NxT[0, 2:6], [False, False, True, True])
  np.testing.assert_array_equal(batch.loss_mask_NxT[1, 2:5], [True, True, True])


# -- the group pool -----------------------------------------------------------

def test_pool_expires_old_rows_and_takes_earliest_completed_groups():
  pool = GroupPool(group_size=2, max_new_tokens=6)
  for i in range(3):
    pool.launch(10 + i, step=0, seeds_Gx2=np.full((2, 2), i))
  version = np.array([[0, 0, 1, 0, 0, 0], [2, 2, 0, 0, 0, 0]] * 3)
  traj = _traj([3, 2, 1, 4, 2, 2], [FINISH_STOP, FINISH_RUNNING, FINISH_STOP, FINISH_STOP,
                                    FINISH_STOP, FINISH_LENGTH], version=version)
  pool.set_rows(traj)
  # At version 3 with max_age 2, rows holding a version-0 token restart.
  # Row 3 finished, but holds version-0 tokens too: it restarts as well.
  assert pool.expire(3, max_age=2) == 3 + 1 + 4 + 2
  rows = pool.rows()
  np.testing.assert_array_equal(rows.length_N, [0, 2, 0, 0, 0, 2])
  assert (rows.finish_N[[0, 1, 2, 3, 4]] == FINISH_RUNNING).all()
  assert not rows.tokens_NxL[0].any()
  pool.set_rows(traj)
  taken = pool.take_complete(2, np.array([3, -1, 5, 4, 2, 2]))
  assert [g.index for g in taken] == [12, 11]  # completed at steps 2 and 5
  assert [g.index for g in pool.groups] == [10]
  with pytest.raises(RuntimeError, match="0 complete groups"):
    pool.take_complete(1, np.array([-1, -1]))


def test_pool_round_trips_through_its_json_state():
  import json

  pool = GroupPool(2, 6)
  pool.launch(4, step=3, seeds_Gx2=np.array([[1, 2], [3, 4]]))
  pool.set_rows(_traj([2, 5], [FINISH_RUNNING, FINISH_STOP], version=np.full((2, 6), 3)))
  other = GroupPool(2, 6)
  other.load_state_dict(json.loads(json.dumps(pool.state_dict())))
  a, b = pool.rows(), other.rows()
  for f in ("tokens_NxL", "logp_NxL", "position_NxL", "version_NxL", "length_N", "finish_N"):
    np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    assert getattr(a, f).dtype == getattr(b, f).dtype
  np.testing.assert_array_equal(other.groups[0].seeds_Gx2, [[1, 2], [3, 4]])
  predictor = HistoryLengthPredictor(2)
  predictor.observe([1, 1, 1, 2], [4, 6, 8, 3])
  again = HistoryLengthPredictor(2)
  again.load_state_dict(json.loads(json.dumps(predictor.state_dict())))
  np.testing.assert_array_equal(again.predict([1, 2, 9]), predictor.predict([1, 2, 9]))


def test_sorted_batches_serve_shortest_predicted_first_and_use_every_prompt():
  cfg = config_lib.apply_overrides(config_lib.ExperimentConfig(), [
      "rollout.prompts_per_step=4", "schedule.sorted_batches=3"])
  batches = iter([np.arange(i * 4, i * 4 + 4) for i in range(12)])
  sr = Sampler(cfg, engine=None, prompts=None, prompt_ids=list(range(100)), score=None, batches=batches,
               key=None)
  sr.predictor.observe(range(48), [(7 * i) % 11 for i in range(48)])  # known lengths
  drawn = [sr._draw(4) for _ in range(6)]
  # Each 3-batch look-ahead (12 prompts) is served in 3 steps, shortest first.
  for window in (drawn[:3], drawn[3:]):
    served = [i for batch in window for i in batch]
    assert sorted(served) == sorted(set(served)) and len(served) == 12
    lengths = [[(7 * i) % 11 for i in batch] for batch in window]
    assert max(lengths[0]) <= min(lengths[1]) and max(lengths[1]) <= min(lengths[2])
  assert sorted(i for b in drawn for i in b) == list(range(24))


@pytest.mark.parametrize("override,match", [
    ("schedule.over_provision=0.9", "over_provision must be >= 1"),
    ("schedule.budgets=16@0,8@10", "decreases"),
    ("schedule.max_age=-1", "max_age must be >= 0"),
    ("schedule.order=sjf", "schedule.order"),
    ("schedule.truncation=clip", "schedule.truncation"),
    ("schedule.sorted_batches=-2", "sorted_batches"),
])
def test_invalid_schedule_settings_are_rejected(override, match):
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.apply_overrides(config_lib.ExperimentConfig(), [override])
