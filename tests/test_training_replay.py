"""Training with algorithmic-lever transforms: a chained config end to end,
its replay state through a resume, and configs rejected before training."""

import json
import os

import pytest

from jaxroll import config as config_lib
from test_training import read, resume_from_step_4, tiny, train_once

# A pool of 8 prompts, so that each recurs every step or two and GRESO has
# a history to skip by.
CHAIN = ["algorithm.techniques=greso,vigor", "algorithm.vigor_round=4", "rl.minibatches=1",
         "keep_checkpoints=10", "report=false", "warm_start.steps=60", "task.num_train=8"]


def _metrics(run_dir):
  return [json.loads(x) for x in read(run_dir, "metrics.jsonl").splitlines()]


@pytest.fixture(scope="module")
def chained_run(tmp_path_factory):
  return train_once(tmp_path_factory, "chain", *CHAIN)


def test_greso_then_vigor_runs_end_to_end_and_spends_the_budget(chained_run):
  steps = _metrics(chained_run)[1:]
  assert len(steps) == 8
  degenerate_seen = 0
  for m in steps:
    # VIGOR allocates the baseline's 4 x 4 = 16 rollouts per step over 4 prompts.
    assert m["rollouts_generated"] == 16 and m["groups_used"] == 4
    # Each planning round draws candidates (2.0) x prompts_per_step (4) = 8.
    assert m["prompts_considered"] == 8 * m["plan_rounds"]
    # GRESO skips only prompts whose last groups were degenerate: none
    # before the first degenerate group is seen.
    if degenerate_seen == 0:
      assert m["prompts_skipped"] == 0
    degenerate_seen += m["degenerate_generated"]
  assert steps[-1]["cumulative_rollouts"] == 8 * 16
  assert degenerate_seen > 0 and sum(m["prompts_skipped"] for m in steps) > 0


@pytest.mark.slow
def test_resume_restores_the_replay_and_transform_states(chained_run, tmp_path):
  run_dir = resume_from_step_4(chained_run, tmp_path, *CHAIN)
  assert read(run_dir, "metrics.jsonl") == read(chained_run, "metrics.jsonl")


# A shorter task and a wider policy than tiny's, so groups have mixed rewards.
POPO = ["algorithm.techniques=popo", "algorithm.popo_max_age=3", "keep_checkpoints=10", "report=false",
        "warm_start.steps=200", "task.max_steps=2", "policy.hidden_size=64", "policy.mlp_dim=128"]


@pytest.fixture(scope="module")
def popo_run(tmp_path_factory):
  return train_once(tmp_path_factory, "popo", *POPO)


def test_popo_replays_buffered_groups_without_extra_rollouts(popo_run):
  steps = _metrics(popo_run)[1:]
  assert all(m["rollouts_generated"] == 16 for m in steps)  # replay costs no rollouts
  replayed = sum(m["groups_replayed"] for m in steps)
  assert replayed > 0
  for m in steps:
    # Only degenerate fresh groups are replaced, never more than were generated.
    assert m["groups_replayed"] <= m["degenerate_generated"]
    assert 0 < m["replay_age_mean"] <= 3 or m["groups_replayed"] == 0
    # The decoupled objective's weights are recorded; fresh tokens weigh 1.
    assert 0 < m["is_weight_mean"] <= 2.0 and 0 < m["is_ess"] <= 1.0
  # A replayed group's tokens were sampled by an older policy: weights differ from 1.
  assert any(m["is_weight_max"] > 1.0 for m in steps if m["groups_replayed"])


@pytest.mark.slow
def test_resume_restores_the_replay_buffer(popo_run, tmp_path):
  run_dir = resume_from_step_4(popo_run, tmp_path, *POPO)
  assert read(run_dir, "metrics.jsonl") == read(popo_run, "metrics.jsonl")


@pytest.mark.parametrize("overrides,match", [
    (["algorithm.techniques=greso,vigro"], "unknown technique 'vigro'; did you mean 'vigor'"),
    (["algorithm.techniques=greso,random_foo"], "unknown technique 'random_foo'"),
    (["algorithm.techniques=greso,vigor", "algorithm.budget=-4"], "algorithm.budget and .* must be >= 0"),
    (["algorithm.techniques=greso,vigor", "algorithm.greso_target=1.5"], "greso target must be in \\(0, 1\\)"),
    (["algorithm.techniques=mopps", "algorithm.mopps_target=0"], "mopps target must be in \\(0, 1\\)"),
    (["algorithm.techniques=popo", "algorithm.popo_max_age=0"], "popo max_age must be >= 1"),
    (["algorithm.techniques=random_popo", "algorithm.popo_buffer=0"], "popo_buffer must be >= 1"),
    (["rl.is_cap=0.5"], "rl.is_cap must be >= 1"),
    (["rl.off_policy=vtrace"], "rl.off_policy=.vtrace. is not one of"),
    (["rollout.param_dtype=float16"], "rollout.param_dtype=.float16. is not one of"),
])
def test_invalid_algorithm_configs_are_rejected_before_training(overrides, match, tmp_path):
  with pytest.raises(config_lib.ConfigError, match=match):
    tiny(str(tmp_path / "never"), *overrides)
  assert not os.path.exists(tmp_path / "never")
