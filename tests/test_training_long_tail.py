"""Training with a long-tail schedule: over-provisioning, carry-over across
steps, LPT admission, a budget curriculum and a truncation treatment."""

import json
import os
import shutil

import pytest

from jaxroll.train import train
from test_training import read, tiny

PARTIAL = ["schedule.over_provision=1.5", "schedule.order=lpt", "schedule.predictor=sibling_probe",
           "schedule.budgets=8@0,12@4", "schedule.truncation=mask", "schedule.max_age=1",
           "rollout.num_slots=8", "keep_checkpoints=10", "report=false"]


def _metrics(run_dir):
  return [json.loads(x) for x in read(run_dir, "metrics.jsonl").splitlines()]


@pytest.fixture(scope="module")
def partial_run(tmp_path_factory):
  run_dir = str(tmp_path_factory.mktemp("partial") / "run")
  train(tiny(run_dir, *PARTIAL))
  return run_dir


def test_partial_rollout_carries_rows_across_steps(partial_run):
  steps = _metrics(partial_run)[1:]
  assert len(steps) == 8
  assert [m["response_budget"] for m in steps] == [8] * 4 + [12] * 4
  assert sum(m["rows_carried_over"] for m in steps) > 0
  assert sum(m["carried_tokens_in_update"] for m in steps) > 0
  # Six groups in flight for four per update; none is dropped.
  assert steps[0]["groups_launched"] == 6
  assert all(m["groups_in_flight"] == 2 for m in steps)
  assert sum(m["groups_launched"] for m in steps) == 8 * 4 + 2
  for m in steps:
    assert m["token_age_max"] <= 1  # max_age
    # Truncated rows are masked out of the loss (schedule.truncation=mask).
    if m["truncated_fraction"] == 0:
      assert m["loss_tokens"] == m["length_mean"] * 16
    else:
      assert m["loss_tokens"] < m["length_mean"] * 16
    assert m["length_pred_mae"] is None or m["length_pred_mae"] >= 0
  trace = [json.loads(x) for x in read(partial_run, "lengths.jsonl").splitlines()]
  assert all(len(r["lengths"]) == 16 and max(r["lengths"]) <= 12 for r in trace)


@pytest.mark.slow
def test_resume_restores_the_groups_in_flight(partial_run, tmp_path):
  """A run resumed from step 4 carries the same rows on and ends identical."""
  run_dir = str(tmp_path / "resumed")
  shutil.copytree(partial_run, run_dir)
  for step in ("6", "8"):
    shutil.rmtree(os.path.join(run_dir, "checkpoints", step))
  assert _metrics(partial_run)[5]["rows_carried_over"] + _metrics(partial_run)[4]["groups_in_flight"] > 0
  train(tiny(run_dir, *PARTIAL), resume=True)
  assert read(run_dir, "metrics.jsonl") == read(partial_run, "metrics.jsonl")
  assert read(run_dir, "lengths.jsonl") == read(partial_run, "lengths.jsonl")
