"""Sparrow's budget controller: the rule against a hand-worked sequence, and
in training, the budget each batch decoded with follows the logged agreement
and survives a resume."""

import json
import os
import types

import pytest

from jaxroll.config import ConfigError
from jaxroll.loop.kv_budget import KVBudgetController
from test_training import tiny, train_once


def _rollout(**kw):
  base = dict(kv_budget=0.25, kv_budget_step=0.25, kv_budget_p5=0.8, kv_budget_margin=0.1,
              kv_budget_start=0.0)
  return types.SimpleNamespace(**{**base, **kw})


def test_the_budget_rises_below_the_threshold_and_falls_above_it_plus_the_margin():
  c = KVBudgetController(_rollout())
  seen = []
  # p5:  low   low   low   low (at the top)  inside the band  high  none  nan  high  high (at the floor)
  for p5 in (0.1, 0.5, 0.79, 0.0, 0.85, 0.95, None, float("nan"), 0.91, 0.99):
    c.observe({} if p5 is None else {"mismatch_agreement_p5": p5})
    seen.append(c.budget)
  assert seen == [0.5, 0.75, 1.0, 1.0, 1.0, 0.75, 0.75, 0.75, 0.5, 0.25]
  off = KVBudgetController(_rollout(kv_budget_p5=0.0))
  off.observe({"mismatch_agreement_p5": 0.0})
  assert off.budget == 0.25 and off.publish_kw(3) == {} and off.metrics(3) == {}


def test_the_top_step_is_capped_at_dense():
  c = KVBudgetController(_rollout(kv_budget=0.3, kv_budget_step=0.5))
  for _ in range(3):
    c.observe({"mismatch_agreement_p5": 0.0})
  assert c.budget == 1.0 and c.level == 2


def test_a_budget_started_dense_falls_only_while_the_agreement_allows():
  c = KVBudgetController(_rollout(kv_budget_start=1.0))
  assert c.budget == 1.0
  seen = []
  for p5 in (0.95, 0.95, 0.85, 0.5, 0.99, 0.99, 0.99, 0.99):
    c.observe({"mismatch_agreement_p5": p5})
    seen.append(c.budget)
  assert seen == [0.75, 0.5, 0.5, 0.75, 0.5, 0.25, 0.25, 0.25]
  # Between steps the start rounds up; a checkpoint's level wins over it,
  # and one without a level (older runs) keeps the start.
  mid = KVBudgetController(_rollout(kv_budget_start=0.6))
  assert mid.budget == 0.75
  mid.load_state(0)
  assert mid.budget == 0.25
  mid.load_state(None)
  assert mid.budget == 0.75


def _records(run_dir, name):
  with open(os.path.join(run_dir, f"{name}.jsonl")) as f:
    return [json.loads(line) for line in f]


SPARSE = ["rollout.kv_cache=paged", "rollout.kv_page_size=1", "rollout.kv_sparsity=quest",
          "rollout.kv_budget=0.25", "rollout.kv_budget_step=0.25", "rollout.kv_budget_p5=0.99",
          "rollout.kv_budget_margin=0.005", "rl.off_policy=tis", "steps=4", "checkpoint_every=2"]


@pytest.mark.slow
def test_each_batch_decodes_with_the_budget_the_previous_agreement_chose_and_resume_keeps_it(
    tmp_path_factory, tmp_path):
  run_dir = train_once(tmp_path_factory, "controlled", *SPARSE)
  steps = _records(run_dir, "metrics")[1:]
  # Replay the rule on the logged agreements: step s's batch decoded with
  # the budget chosen after step s - 1.
  replay = KVBudgetController(_rollout(kv_budget_p5=0.99, kv_budget_margin=0.005))
  for m in steps:
    assert m["kv_budget"] == replay.budget
    replay.observe(m)
  assert steps[0]["kv_budget"] == 0.25 and len({m["kv_budget"] for m in steps}) > 1
  # Resumed from checkpoint 2 (the budget had moved by then): the same
  # records as the uninterrupted run.
  import shutil

  from jaxroll.train import train

  assert steps[2]["kv_budget"] != 0.25
  again = str(tmp_path / "again")
  shutil.copytree(run_dir, again)
  shutil.rmtree(os.path.join(again, "checkpoints", "4"))
  train(tiny(again, *SPARSE), resume=True)
  assert _records(again, "metrics") == _records(run_dir, "metrics")


@pytest.mark.parametrize("overrides,needle", [
    (["rollout.kv_budget_p5=0.9"], "set rollout.kv_sparsity"),
    (["rollout.kv_cache=paged", "rollout.kv_budget_p5=0.9"], "set rollout.kv_sparsity"),
    (["rollout.kv_cache=paged", "rollout.kv_sparsity=quest", "rollout.kv_budget_p5=0.99",
      "rl.measure_mismatch=false"], "rl.measure_mismatch=true"),
    (["rollout.kv_cache=paged", "rollout.kv_sparsity=quest", "rollout.kv_budget_p5=1.5"], "in \\(0, 1\\)"),
    (["rollout.kv_cache=paged", "rollout.kv_sparsity=quest", "rollout.kv_budget_p5=0.99",
      "rollout.kv_budget_step=0"], "kv_budget_step"),
    (["rollout.kv_cache=paged", "rollout.kv_sparsity=quest", "rollout.kv_budget_start=1"],
     "set rollout.kv_budget_p5"),
    (["rollout.kv_cache=paged", "rollout.kv_sparsity=quest", "rollout.kv_budget_p5=0.99",
      "rollout.kv_budget_start=0.1"], "kv_budget_start must be"),
    (["rollout.kv_cache=paged", "rollout.kv_sparsity=quest", "rollout.kv_budget_p5=0.95",
      "rollout.kv_budget_start=1"], "never falls"),
])
def test_bad_controller_settings_fail_before_any_work(overrides, needle, tmp_path):
  with pytest.raises(ConfigError, match=needle):
    tiny(str(tmp_path / "run"), *overrides)
