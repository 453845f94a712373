"""Kill `jaxroll train` anywhere, damage its newest checkpoint, change its
config on resume: the run folder never loses a step and never gets stuck.

Each kill is a SIGKILL, at a named point of the loop (jaxroll.faults) or
at a random instant; the re-run is the same command, with --resume where
the folder holds a checkpoint, and its metrics.jsonl and lengths.jsonl
must equal an uninterrupted run's byte for byte.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from jaxroll import config as config_lib, run_folder
from test_training import ROOT, tiny

# For this tiny config (kl_coef > 0, checkpoint_every=2, 8 steps) the saves
# are, in order: 1 warm start, 2 KL reference, 3..7 checkpoints 0, 2, 4, 6, 8.
# The n in point:n counts arrivals from the start of the killed process.
# One point of each kind (mid warm start, checkpoint 2 half written,
# checkpoint 0 saved but not yet committed, ...): each resume path once,
# within the suite's time.
FAULTS = [
    "run_started", "warm_start_step:29", "warm_start_saved", "eval_done:1", "checkpoint_write:4",
    "checkpoint_saved:3", "checkpoint_committed:5", "logged:2", "step_done:6",
]
RANDOM_FRACTIONS = [0.6]  # of the uninterrupted run's wall time


def cli_env(cache_dir, fault=None):
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache_dir,
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
         "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
  env.pop("JAXROLL_FAULT", None)
  if fault:
    env["JAXROLL_FAULT"] = fault
  return env


def command(cfg_path, *extra):
  return [sys.executable, "-m", "jaxroll.cli", "train", str(cfg_path), *extra]


def read(run_dir, name):
  with open(os.path.join(run_dir, name), "rb") as f:
    return f.read()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted CLI run: (its folder, the compilation cache, wall seconds)."""
  base = tmp_path_factory.mktemp("lifecycle")
  cache = str(base / "jax_cache")
  run_dir = str(base / "ref")
  cfg_path = base / "ref.json"
  cfg_path.write_text(json.dumps(config_lib.to_dict(tiny(run_dir))))
  subprocess.run(command(cfg_path), cwd=ROOT, env=cli_env(cache), check=True, capture_output=True,
                 timeout=600)  # fills the compilation cache
  shutil.rmtree(run_dir)
  t0 = time.monotonic()
  subprocess.run(command(cfg_path), cwd=ROOT, env=cli_env(cache), check=True, capture_output=True,
                 timeout=600)
  return run_dir, cache, time.monotonic() - t0


def config_for(tmp_path, name="run"):
  run_dir = str(tmp_path / name)
  cfg_path = tmp_path / f"{name}.json"
  cfg_path.write_text(json.dumps(config_lib.to_dict(tiny(run_dir))))
  return run_dir, cfg_path


def rerun_after_kill(run_dir, cfg_path, cache):
  """The same command again, with --resume exactly when the folder has a checkpoint."""
  state = run_folder.state(run_dir)
  assert state in ("unstarted", "resumable"), state
  if state == "resumable":
    refused = subprocess.run(command(cfg_path), cwd=ROOT, env=cli_env(cache), capture_output=True,
                             text=True, timeout=300)
    assert refused.returncode == 2 and "--resume" in refused.stderr, refused.stderr[-2000:]
  out = subprocess.run(command(cfg_path, *(["--resume"] if state == "resumable" else [])), cwd=ROOT,
                       env=cli_env(cache), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return state, out.stderr


def assert_same_logs(run_dir, ref_dir):
  assert read(run_dir, "metrics.jsonl") == read(ref_dir, "metrics.jsonl")
  assert read(run_dir, "lengths.jsonl") == read(ref_dir, "lengths.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
def test_a_kill_at_a_loop_boundary_resumes_to_identical_logs(fault, reference, tmp_path):
  ref_dir, cache, _ = reference
  run_dir, cfg_path = config_for(tmp_path)
  killed = subprocess.run(command(cfg_path), cwd=ROOT, env=cli_env(cache, fault),
                          capture_output=True, text=True, timeout=600)
  assert killed.returncode == -signal.SIGKILL, f"{fault} was never reached: {killed.stderr[-2000:]}"
  state, err = rerun_after_kill(run_dir, cfg_path, cache)
  assert_same_logs(run_dir, ref_dir)
  if fault.startswith("eval_done:1"):
    # Killed after the warm start committed, before checkpoint 0: reused, not retrained.
    assert state == "unstarted" and "loading the warm-started policy" in err


@pytest.mark.slow
@pytest.mark.parametrize("fraction", RANDOM_FRACTIONS)
def test_a_kill_at_a_random_instant_resumes_to_identical_logs(fraction, reference, tmp_path):
  ref_dir, cache, wall_s = reference
  run_dir, cfg_path = config_for(tmp_path)
  proc = subprocess.Popen(command(cfg_path), cwd=ROOT, env=cli_env(cache),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  time.sleep(fraction * wall_s)
  if proc.poll() is not None:
    pytest.skip("the run finished before the kill (a faster machine than the reference run)")
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  rerun_after_kill(run_dir, cfg_path, cache)
  assert_same_logs(run_dir, ref_dir)


def damage(step_dir, how):
  """Damages a committed checkpoint the three ways a disk or a person does."""
  arrays = os.path.join(step_dir, "params", "ocdbt.process_0", "d")
  biggest = max((os.path.join(arrays, f) for f in os.listdir(arrays)), key=os.path.getsize)
  if how == "truncated":
    with open(biggest, "r+b") as f:
      f.truncate(os.path.getsize(biggest) // 2)
  elif how == "deleted_metadata":
    os.remove(os.path.join(step_dir, "params", "_METADATA"))
  else:
    with open(biggest, "r+b") as f:
      f.seek(os.path.getsize(biggest) // 2)
      f.write(b"\0" * 64)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated", "deleted_metadata", "overwritten"])
def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_used(how, reference, tmp_path):
  ref_dir, cache, _ = reference
  run_dir, cfg_path = config_for(tmp_path)
  shutil.copytree(ref_dir, run_dir)
  # The finished run keeps checkpoints 6 and 8; damage 8.
  assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["6", "8"]
  damage(os.path.join(run_dir, "checkpoints", "8"), how)
  out = subprocess.run(command(cfg_path, "--resume"), cwd=ROOT, env=cli_env(cache),
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  named = [line for line in out.stderr.splitlines() if "damaged" in line]
  assert len(named) == 1 and "checkpoint step 8" in named[0] and "resuming from step 6" in named[0]
  assert "Traceback" not in out.stderr
  assert os.path.isdir(os.path.join(run_dir, "checkpoints.set_aside", "8"))
  assert_same_logs(run_dir, ref_dir)


@pytest.mark.slow
def test_resume_with_more_steps_continues_and_records_the_change(reference, tmp_path):
  ref_dir, cache, _ = reference
  run_dir, cfg_path = config_for(tmp_path)
  shutil.copytree(ref_dir, run_dir)
  config_before = read(run_dir, "config.json")
  out = subprocess.run(command(cfg_path, "--resume", "--set", "steps=10"), cwd=ROOT,
                       env=cli_env(cache), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  metrics = [json.loads(x) for x in read(run_dir, "metrics.jsonl").splitlines()]
  assert [m["step"] for m in metrics] == list(range(11))
  assert read(run_dir, "metrics.jsonl").startswith(read(ref_dir, "metrics.jsonl"))
  info = json.loads(read(run_dir, "run_info.json"))
  assert info["resumes"][-1]["from_step"] == 8
  assert info["resumes"][-1]["changed"] == {"steps": [8, 10]}
  assert read(run_dir, "config.json") == config_before  # never rewritten silently
  # The recorded change is part of the run's config now: resuming again with
  # steps=10 changes nothing, and the run is finished.
  assert run_folder.effective_config(run_dir).steps == 10
