"""Training with the rollout thread: bounded lag, phase accounting, a crash
in the thread, and Ctrl-C, each leaving a resumable run."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxroll import config as config_lib
from jaxroll.loop.sampler import Sampler
from jaxroll.pipeline.producer import RolloutThreadError
from jaxroll.train import train
from test_training import ROOT, read, tiny

PIPE = ["pipeline.mode=async", "pipeline.max_lag=2", "rl.off_policy=tis", "report=false",
        "checkpoint_every=100", "keep_checkpoints=10"]


def _metrics(run_dir):
  return [json.loads(x) for x in read(run_dir, "metrics.jsonl").splitlines()]


def _checkpoints(run_dir):
  return sorted(int(d) for d in os.listdir(os.path.join(run_dir, "checkpoints")) if d.isdigit())


def test_async_run_bounds_the_lag_and_records_both_sides_idle_time(tmp_path):
  run_dir = str(tmp_path / "run")
  train(tiny(run_dir, *PIPE))
  steps = _metrics(run_dir)[1:]
  assert [m["step"] for m in steps] == list(range(1, 9))  # no step lost
  # The tokens' recorded versions (written by the engine when it sampled)
  # give each batch's lag independently of the driver's bookkeeping: an
  # async batch is sampled by one version throughout, so the two agree.
  assert [m["token_age_max"] for m in steps] == [m["policy_lag"] for m in steps]
  assert [m["token_age_mean"] for m in steps] == [float(m["policy_lag"]) for m in steps]
  assert steps[0]["policy_lag"] == 0  # nothing to be behind at the first update
  assert max(m["policy_lag"] for m in steps) >= 1  # the thread did sample ahead
  assert max(m["policy_lag"] for m in steps) <= 2
  assert steps[-1]["cumulative_rollouts"] == 8 * 16
  # Lagged tokens are weighted: the truncated IS weights are not all 1.
  assert any(m["is_weight_max"] != 1.0 for m in steps if m["policy_lag"] > 0)
  timing = [json.loads(x) for x in read(run_dir, "timing.jsonl").splitlines()][1:]
  ahead = [t for t, m in zip(timing, steps) if m["policy_lag"] > 0]
  # A batch sampled ahead was (mostly) produced while the trainer updated:
  # the trainer waited less than the thread worked.
  assert sum(t["train_wait_s"] for t in ahead) < sum(t["rollout_busy_s"] for t in ahead)


def test_a_crash_in_the_rollout_thread_stops_the_run_with_a_resumable_checkpoint(tmp_path, monkeypatch):
  run_dir = str(tmp_path / "run")
  real = Sampler.run

  def failing(self, dparams, step, feed=None):
    if step == 5:
      raise ZeroDivisionError("the sampler exploded")
    return real(self, dparams, step, feed=feed)

  monkeypatch.setattr(Sampler, "run", failing)
  with pytest.raises(RolloutThreadError) as info:
    train(tiny(run_dir, *PIPE))
  assert isinstance(info.value.__cause__, ZeroDivisionError)
  logged = _metrics(run_dir)[-1]["step"]
  assert logged == 5  # steps 1..5 used batches 0..4, all produced before the crash
  assert _checkpoints(run_dir)[-1] == logged  # the last completed step is saved
  monkeypatch.undo()
  train(tiny(run_dir, *PIPE), resume=True)
  assert [m["step"] for m in _metrics(run_dir)] == list(range(9))


@pytest.mark.slow
def test_ctrl_c_stops_at_a_step_boundary_with_a_resumable_checkpoint(tmp_path):
  run_dir = str(tmp_path / "run")
  cfg_path = tmp_path / "cfg.json"
  cfg_path.write_text(json.dumps(config_lib.to_dict(tiny(run_dir, *PIPE, "steps=40"))))
  cmd = [sys.executable, "-m", "jaxroll.cli", "train", str(cfg_path)]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 300
  while (not os.path.exists(os.path.join(run_dir, "metrics.jsonl")) or len(_metrics(run_dir)) < 4) \
      and proc.poll() is None and time.monotonic() < deadline:
    time.sleep(0.02)
  assert proc.poll() is None, "the run finished before it could be interrupted"
  os.kill(proc.pid, signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err[-3000:]
  assert "--resume" in err
  logged = _metrics(run_dir)[-1]["step"]
  assert 3 <= logged < 40 and _checkpoints(run_dir)[-1] == logged
  out = subprocess.run(cmd + ["--resume"], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert [m["step"] for m in _metrics(run_dir)] == list(range(41))
