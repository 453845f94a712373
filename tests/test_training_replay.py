"""Training with algorithmic-lever transforms: a chained config end to end,
its replay state through a resume, and configs rejected before training."""

import json
import os
import shutil

import pytest

from jaxroll import config as config_lib
from jaxroll.train import train
from test_training import read, tiny

CHAIN = ["algorithm.techniques=greso,vigor", "algorithm.vigor_round=4", "rl.minibatches=1",
         "keep_checkpoints=10", "report=false", "warm_start.steps=60"]


def _metrics(run_dir):
  return [json.loads(x) for x in read(run_dir, "metrics.jsonl").splitlines()]


@pytest.fixture(scope="module")
def chained_run(tmp_path_factory):
  run_dir = str(tmp_path_factory.mktemp("chain") / "run")
  train(tiny(run_dir, *CHAIN))
  return run_dir


def test_greso_then_vigor_runs_end_to_end_and_spends_the_budget(chained_run):
  steps = _metrics(chained_run)[1:]
  assert len(steps) == 8
  for m in steps:
    # VIGOR allocates the baseline's 4 x 4 = 16 rollouts per step over 4 prompts.
    assert m["rollouts_generated"] == 16 and m["groups_used"] == 4
    assert m["prompts_considered"] >= 8 and m["plan_rounds"] >= 1
  assert steps[-1]["cumulative_rollouts"] == 8 * 16


@pytest.mark.slow
def test_resume_restores_the_replay_and_transform_states(chained_run, tmp_path):
  run_dir = str(tmp_path / "resumed")
  shutil.copytree(chained_run, run_dir)
  for step in ("6", "8"):
    shutil.rmtree(os.path.join(run_dir, "checkpoints", step))
  train(tiny(run_dir, *CHAIN), resume=True)
  assert read(run_dir, "metrics.jsonl") == read(chained_run, "metrics.jsonl")


@pytest.mark.parametrize("overrides,match", [
    (["algorithm.techniques=greso,vigro"], "unknown technique 'vigro'; did you mean 'vigor'"),
    (["algorithm.techniques=greso,random_foo"], "unknown technique 'random_foo'"),
    (["algorithm.techniques=greso,vigor", "algorithm.budget=-4"], "algorithm.budget and .* must be >= 0"),
    (["algorithm.techniques=greso,vigor", "algorithm.greso_target=1.5"], "greso target must be in \\(0, 1\\)"),
    (["algorithm.techniques=mopps", "algorithm.mopps_target=0"], "mopps target must be in \\(0, 1\\)"),
    (["algorithm.techniques=vigor", "schedule.over_provision=1.5"], "synchronous schedule"),
])
def test_invalid_algorithm_configs_are_rejected_before_training(overrides, match, tmp_path):
  with pytest.raises(config_lib.ConfigError, match=match):
    tiny(str(tmp_path / "never"), *overrides)
  assert not os.path.exists(tmp_path / "never")
