"""Training with a long-tail schedule: over-provisioning, carry-over across
steps, LPT admission, a budget curriculum and a truncation treatment."""

import json

import pytest

from test_training import read, resume_from_step_4, train_once

PARTIAL = ["schedule.over_provision=1.5", "schedule.order=lpt", "schedule.predictor=sibling_probe",
           "schedule.budgets=8@0,12@4", "schedule.truncation=mask", "schedule.max_age=1",
           "rollout.num_slots=8", "keep_checkpoints=10", "report=false"]


def _metrics(run_dir):
  return [json.loads(x) for x in read(run_dir, "metrics.jsonl").splitlines()]


@pytest.fixture(scope="module")
def partial_run(tmp_path_factory):
  return train_once(tmp_path_factory, "partial", *PARTIAL)


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
  # The sibling probe's predictions are scored on the rows that finished:
  # a probe length and a realised length both lie in [1, budget], so the
  # error does too; a broken scorer (no predictions, wrong units) fails here.
  scored = [m for m in steps if m["length_pred_mae"] is not None]
  assert len(scored) >= len(steps) // 2
  assert all(0 <= m["length_pred_mae"] <= m["response_budget"] for m in scored)
  assert any(m["length_pred_mae"] > 0 for m in scored)  # not a copy of the realised lengths
  trace = [json.loads(x) for x in read(partial_run, "lengths.jsonl").splitlines()]
  assert all(len(r["lengths"]) == 16 and max(r["lengths"]) <= 12 for r in trace)


@pytest.mark.slow
def test_resume_restores_the_groups_in_flight(partial_run, tmp_path):
  """A run resumed from step 4 carries the same rows on and ends identical."""
  assert _metrics(partial_run)[5]["rows_carried_over"] + _metrics(partial_run)[4]["groups_in_flight"] > 0
  run_dir = resume_from_step_4(partial_run, tmp_path, *PARTIAL)
  assert read(run_dir, "metrics.jsonl") == read(partial_run, "metrics.jsonl")
  assert read(run_dir, "lengths.jsonl") == read(partial_run, "lengths.jsonl")
