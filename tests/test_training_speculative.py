"""Training with speculative rollout: it drafts, stays on policy, resumes, and reports."""

import json
import os

import pytest

from jaxroll import config as config_lib
from jaxroll.config import ConfigError
from test_training import read, resume_from_step_4, tiny, train_once

# A small pool, so prompts recur and the history drafter has answers to draft from.
SPEC = ["rollout.speculative=history,siblings", "task.num_train=8", "rollout.speculative_k=3",
        "keep_checkpoints=10"]


def _metrics(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def spec_run(tmp_path_factory):
  return train_once(tmp_path_factory, "spec", *SPEC)


def test_speculative_training_drafts_and_stays_on_policy(spec_run):
  steps = _metrics(spec_run)[1:]
  assert sum(m["spec_drafted_tokens"] for m in steps) > 0
  assert max(m["spec_tokens_per_forward"] for m in steps) > 1.0
  # The recorded behaviour log-probs are the policy's own: the update's
  # ratio at its start is 1 (no mismatch beyond float rounding).
  for m in steps:
    assert 0.0 <= m["spec_acceptance_rate"] <= 1.0
    assert 0.0 <= m["slot_idle_fraction"] <= 1.0
  report = read(spec_run, "report.md")
  assert "speculative decoding" in report and "speculative.png" in report
  assert os.path.exists(os.path.join(spec_run, "speculative.png"))


def test_speculative_training_resumes_byte_identical(spec_run, tmp_path):
  """The drafter's history is saved with each checkpoint, so a resumed run
  drafts, accepts and samples exactly what the uninterrupted one did."""
  run_dir = resume_from_step_4(spec_run, tmp_path, *SPEC)
  assert read(run_dir, "metrics.jsonl") == read(spec_run, "metrics.jsonl")


@pytest.mark.parametrize("override,needle", [
    ("rollout.speculative=suffix_tree", "drafters are 'history' and 'siblings'"),
    ("rollout.speculative_k=0", "speculative_k"),
    ("rollout.speculative=global", "add 'history'"),
])
def test_bad_speculative_settings_fail_before_any_work(override, needle, tmp_path):
  with pytest.raises(ConfigError, match=needle):
    tiny(str(tmp_path / "run"), "rollout.speculative=history", override)


def test_the_global_window_reaches_the_engine(tmp_path):
  from jaxroll.rollout.speculative import spec_from_config
  cfg = tiny(str(tmp_path / "run"), "rollout.speculative=history,global")
  spec = spec_from_config(cfg.rollout)
  assert spec.history and spec.global_tokens == spec.history_tokens > 0


def test_speculation_with_a_rollout_head_is_refused(tmp_path):
  with pytest.raises(ConfigError, match="r2po"):
    config_lib.apply_overrides(config_lib.ExperimentConfig(),
                               ["rollout.speculative=history", "behaviour.kind=r2po"])


def test_layer_skip_drafts_in_training_and_records_the_policys_log_probs(tmp_path):
  """The self-speculative drafter (the first of two layers) in a training
  run: it drafts and is accepted, and the behaviour log-probs it records
  are the full policy's (the trainer's rescoring finds no mismatch)."""
  run_dir = str(tmp_path / "run")
  cfg = tiny(run_dir, "steps=3", "eval_every=3", "policy.num_layers=2",
                        "rollout.speculative=layer_skip", "rollout.speculative_k=3",
                        "rl.measure_mismatch=true")
  from jaxroll.train import train
  train(cfg)
  steps = _metrics(run_dir)[1:]
  assert sum(m["spec_drafted_tokens"] for m in steps) > 0
  assert max(m["spec_tokens_per_forward"] for m in steps) > 1.0
  assert max(m["mismatch_max"] for m in steps) < 1e-4
