"""Resuming runs whose techniques, schedule and pipeline mode are combined:
synchronous ones byte for byte, asynchronous ones without losing or
repeating a batch."""

import json

import pytest

from jaxroll.loop.invariants import violations
from test_training import read, resume_from_step_4, train_once

# A prompt filter and DAPO's refill under LPT with the sibling probe,
# over-provisioning with carry-over and a budget curriculum.
SYNC = ["algorithm.techniques=greso,dapo", "schedule.over_provision=1.5", "schedule.order=lpt",
        "schedule.predictor=sibling_probe", "schedule.budgets=8@0,12@4", "schedule.max_age=1",
        "rollout.num_slots=8", "keep_checkpoints=10", "report=false"]
ASYNC = ["algorithm.techniques=greso", "schedule.over_provision=1.25", "schedule.order=lpt",
         "pipeline.mode=async", "pipeline.max_lag=1", "rl.off_policy=tis", "keep_checkpoints=10",
         "report=false"]


def _metrics(run_dir):
  return [json.loads(x) for x in read(run_dir, "metrics.jsonl").splitlines()]


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
  return train_once(tmp_path_factory, "sync_combined", *SYNC)


def test_combined_sync_run_keeps_the_invariants_and_carries_groups(sync_run):
  assert violations(sync_run) == []
  steps = _metrics(sync_run)[1:]
  assert sum(m["rows_carried_over"] for m in steps) > 0
  assert sum(m["groups_selected_out"] for m in steps) + sum(m["prompts_skipped"] for m in steps) > 0


@pytest.mark.slow
def test_combined_sync_run_resumes_byte_identical(sync_run, tmp_path):
  run_dir = resume_from_step_4(sync_run, tmp_path, *SYNC)
  assert read(run_dir, "metrics.jsonl") == read(sync_run, "metrics.jsonl")
  assert read(run_dir, "lengths.jsonl") == read(sync_run, "lengths.jsonl")


@pytest.mark.slow
def test_combined_async_run_resumes_without_losing_or_repeating_a_batch(tmp_path_factory, tmp_path):
  full = train_once(tmp_path_factory, "async_combined", *ASYNC)
  run_dir = resume_from_step_4(full, tmp_path, *ASYNC)
  assert violations(full) == [] and violations(run_dir) == []
  resumed = _metrics(run_dir)
  assert [m["step"] for m in resumed] == list(range(9))
  # Steps up to the checkpoint are kept as they were; the batch of step 5
  # is sampled from the sampler state saved with step 4 (the thread's pool
  # and queue as of that batch), so the prompts it draws continue the run.
  assert resumed[:5] == _metrics(full)[:5]
  trace_full = [json.loads(x) for x in read(full, "lengths.jsonl").splitlines()]
  trace = [json.loads(x) for x in read(run_dir, "lengths.jsonl").splitlines()]
  assert [t["step"] for t in trace] == list(range(1, 9))
  assert trace[:4] == trace_full[:4]


def test_async_with_stale_tokens_masked_trains_on_the_batchs_own_tokens(tmp_path_factory):
  """schedule.stale_tokens=mask leaves out tokens sampled before the batch's
  rollout began (carried rows), not the batch itself: with async, whose
  every batch trails the update by a version, each step still has a loss."""
  run = train_once(tmp_path_factory, "async_mask", "pipeline.mode=async", "pipeline.max_lag=1",
                   "rl.off_policy=tis", "schedule.stale_tokens=mask", "schedule.over_provision=1.5",
                   "report=false")
  assert violations(run) == []
  steps = _metrics(run)[1:]
  assert all(0 < m["loss_tokens"] <= m["length_mean"] * 16 for m in steps)
  assert any(m["policy_lag"] == 1 for m in steps)
