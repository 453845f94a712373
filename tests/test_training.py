"""End-to-end training runs on a tiny config: reproducibility, resume, bad input."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxroll import config as config_lib
from jaxroll.run_folder import RunFolderError
from jaxroll.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "steps=8", "eval_every=4", "eval_samples=2", "checkpoint_every=2", "progress=false",
    "task.num_train=400", "task.num_heldout=16", "task.max_steps=6",
    "policy.hidden_size=32", "policy.num_layers=1", "policy.num_heads=2", "policy.num_kv_heads=1",
    "policy.mlp_dim=64", "warm_start.steps=30", "warm_start.batch_size=16",
    "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.num_slots=16",
    "rollout.max_new_tokens=12", "rl.minibatches=2", "rl.kl_coef=0.01",
]


def tiny(run_dir, *extra):
  return config_lib.apply_overrides(config_lib.ExperimentConfig(),
                                    TINY + [f"run_dir={run_dir}", *extra])


def read(run_dir, name):
  with open(os.path.join(run_dir, name)) as f:
    return f.read()


def train_once(tmp_path_factory, name, *overrides):
  """A tiny run with `overrides`, for a module-scoped fixture; returns its folder."""
  run_dir = str(tmp_path_factory.mktemp(name) / "run")
  train(tiny(run_dir, *overrides))
  return run_dir


def resume_from_step_4(finished_dir, tmp_path, *overrides):
  """Copies an 8-step run, drops its checkpoints after step 4, resumes it;
  returns the resumed folder (whose files should equal the original's)."""
  import shutil

  run_dir = str(tmp_path / "resumed")
  shutil.copytree(finished_dir, run_dir)
  for step in ("6", "8"):
    shutil.rmtree(os.path.join(run_dir, "checkpoints", step))
  # Without it the "resume" would be a fresh run (pass keep_checkpoints=10).
  assert os.path.isdir(os.path.join(run_dir, "checkpoints", "4")), "the run kept no step-4 checkpoint"
  train(tiny(run_dir, *overrides), resume=True)
  return run_dir


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
  run_dir = str(tmp_path_factory.mktemp("ref") / "run")
  return run_dir, train(tiny(run_dir))


def test_run_folder_has_everything_to_reproduce_it(reference_run):
  run_dir, result = reference_run
  for name in ("config.json", "run_info.json", "metrics.jsonl", "timing.jsonl", "warm_start.jsonl",
               "report.md", "cost_to_quality.png", "curves.png"):
    assert os.path.isfile(os.path.join(run_dir, name)), name
  assert os.listdir(os.path.join(run_dir, "tb"))
  info = json.loads(read(run_dir, "run_info.json"))
  assert info["seed"] == 0 and info["git_commit"] and info["packages"]["jax"] != "not installed"
  if os.path.exists("/proc/cpuinfo"):  # the CPU, whose vector extensions change XLA:CPU's rounding
    with open("/proc/cpuinfo") as f:
      assert info["cpu"]["model"] in f.read()
  assert config_lib.load(os.path.join(run_dir, "config.json")) == tiny(run_dir)
  metrics = [json.loads(x) for x in read(run_dir, "metrics.jsonl").splitlines()]
  assert [m["step"] for m in metrics] == list(range(9))
  assert [m["step"] for m in metrics if "heldout_accuracy" in m] == [0, 4, 8]
  step = metrics[-1]
  for key in ("reward_mean", "degenerate_fraction", "length_mean", "length_p90", "length_cv",
              "tokens_generated", "rollouts_generated", "cumulative_tokens", "kl", "clip_fraction"):
    assert key in step, key
  assert step["cumulative_rollouts"] == 8 * 16
  # The sampler and the trainer hold the same float32 weights: they agree to rounding.
  assert all(m["mismatch_max"] < 1e-4 for m in metrics[1:])
  assert step["cumulative_tokens"] == sum(m.get("tokens_generated", 0) for m in metrics)
  timing = [json.loads(x) for x in read(run_dir, "timing.jsonl").splitlines()]
  for key in ("rollout_s", "reward_s", "update_s", "weight_sync_s", "rollout_share", "tokens_per_s"):
    assert key in timing[-1], key
  # The first update compiles it; compile seconds are part of the update's.
  updates = [t for t in timing if "update_s" in t]
  assert 0 < updates[0]["update_compile_s"] <= updates[0]["update_s"]
  assert all(0 <= t["update_compile_s"] <= t["update_s"] for t in updates)
  # The step's compile seconds hold the update's and the rollout's (its
  # first prefill and insert compile in step 1); the net seconds are the
  # rest, accumulated.
  assert all(t["update_compile_s"] <= t["step_compile_s"] <= t["step_s"] for t in updates)
  assert updates[0]["step_compile_s"] > updates[0]["update_compile_s"]
  # XLA's compilation is part of the preparation (tracing, lowering, compiling).
  assert all(0 <= t["step_xla_compile_s"] <= t["step_compile_s"] for t in updates)
  assert updates[0]["step_xla_compile_s"] > 0
  net = np.cumsum([t["step_s"] - t["step_compile_s"] for t in updates])
  np.testing.assert_allclose([t["cumulative_steady_s"] for t in updates], net, rtol=1e-9)
  assert updates[-1]["cumulative_train_s"] - updates[-1]["cumulative_steady_s"] == pytest.approx(
      sum(t["step_compile_s"] for t in updates))
  trace = [json.loads(x) for x in read(run_dir, "lengths.jsonl").splitlines()]
  assert [r["step"] for r in trace] == list(range(1, 9))
  assert [sum(r["lengths"]) for r in trace] == [m["tokens_generated"] for m in metrics[1:]]
  assert all(len(r["prompt_ids"]) == len(r["lengths"]) == 16 for r in trace)
  report = read(run_dir, "report.md")
  assert "C(q)" in report and "Reporting checklist" in report
  assert report.count("**") == 16  # the eight checklist items
  assert result["final_accuracy"] == metrics[-1]["heldout_accuracy"]


def test_same_config_and_seed_give_identical_metrics(reference_run, tmp_path):
  run_dir, _ = reference_run
  again = str(tmp_path / "again")
  train(tiny(again))
  assert read(again, "metrics.jsonl") == read(run_dir, "metrics.jsonl")
  assert read(again, "warm_start.jsonl") == read(run_dir, "warm_start.jsonl")


def test_resume_refuses_an_incompatible_config(reference_run, tmp_path):
  ref_dir, _ = reference_run
  import shutil

  run_dir = str(tmp_path / "copy")
  shutil.copytree(ref_dir, run_dir)
  with pytest.raises(RunFolderError, match=r"policy.hidden_size \(run 32, now 48\)"):
    train(tiny(run_dir, "policy.hidden_size=48", "steps=10"), resume=True)
  with pytest.raises(RunFolderError, match="holds no run to resume"):
    train(tiny(str(tmp_path / "empty")), resume=True)


def test_a_raising_reward_scores_zero_and_the_run_continues(tmp_path, monkeypatch):
  from jaxroll.tasks import mod_walk

  real = mod_walk.reward

  def flaky(completion, answer):
    if len(completion.split()) % 2:
      raise RuntimeError("verifier bug")
    return real(completion, answer)

  monkeypatch.setattr(mod_walk, "reward", flaky)
  run_dir = str(tmp_path / "flaky")
  train(tiny(run_dir, "steps=2", "eval_every=2", "report=false", "rl.kl_coef=0"))
  metrics = [json.loads(x) for x in read(run_dir, "metrics.jsonl").splitlines()]
  assert [m["step"] for m in metrics] == [0, 1, 2]
  assert all(m["reward_errors"] > 0 for m in metrics[1:])
