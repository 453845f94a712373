"""Every bad input through the `jaxroll` command: one line, exit code 2, no traceback.

The config and file facts are checked before JAX is imported: those cases
run in a Python whose `import jax` fails, so reaching JAX at all would
surface as an ImportError traceback instead of the one-line message.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxroll import checkpoint_manifest, config as config_lib, run_folder
from jaxroll.model import safetensors_io

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `jax` set to None in sys.modules makes every `import jax` raise ImportError.
NO_JAX = ("import sys; sys.modules['jax'] = None; from jaxroll.cli import main; "
          "sys.exit(main())")
WITH_JAX = "import sys; from jaxroll.cli import main; sys.exit(main())"
SMALL = ["task.num_train=50", "task.num_heldout=8", "warm_start.steps=2"]


def run_cli(*args, jax_allowed=False, env=None):
  out = subprocess.run([sys.executable, "-c", WITH_JAX if jax_allowed else NO_JAX, *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, **(env or {})})
  return out.returncode, out.stderr


def assert_one_line(rc, err, *fragments):
  lines = [line for line in err.splitlines() if line.strip()]
  assert rc == 2, err
  assert "Traceback" not in err, err
  # Log lines (INFO/WARNING) may come first; the error is the one `jaxroll:` line.
  errors = [line for line in lines if line.startswith("jaxroll: ")]
  assert len(errors) == 1 and errors[0] == lines[-1], err
  for fragment in fragments:
    assert fragment in errors[0], (fragment, errors[0])


def train_args(tmp_path, *sets, config="configs/quick.py"):
  args = ["train", config, "--set", f"run_dir={tmp_path / 'run'}"]
  for s in (*SMALL, *sets):
    args += ["--set", s]
  return args


def fake_hf_folder(path, truncate=False):
  """A folder that passes the file checks: config.json and one safetensors file."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({"architectures": ["Qwen2ForCausalLM"]}, f)
  st = os.path.join(path, "model.safetensors")
  safetensors_io.save(st, {"w": np.zeros((64, 64), np.float32)})
  if truncate:
    with open(st, "r+b") as f:
      f.truncate(os.path.getsize(st) // 2)
  return str(path)


def fake_resumable_run(run_dir, cfg):
  """A run folder with config.json and one committed (empty) checkpoint."""
  os.makedirs(os.path.join(run_dir, "checkpoints", "3"))
  run_folder.write_json_atomic(os.path.join(run_dir, "config.json"), config_lib.to_dict(cfg))
  checkpoint_manifest.write_manifest(os.path.join(run_dir, "checkpoints", "3"), {"step": 3})


def qa_file(tmp_path, lines):
  path = tmp_path / "qa.jsonl"
  path.write_text("\n".join(lines) + "\n")
  return str(path)


CONFIG_FACTS = {
    "negative temperature": (["rollout.temperature=-0.5"], ["rollout.temperature", ">= 0"]),
    "top_p of 0": (["rollout.top_p=0"], ["rollout.top_p", "(0, 1]"]),
    "heads not a multiple of kv heads": (["policy.num_heads=3", "policy.num_kv_heads=2"],
                                         ["policy.num_heads=3", "multiple of policy.num_kv_heads=2"]),
    "prompts longer than max_prompt_len": (["rollout.max_prompt_len=3"],
                                           ["exceed rollout.max_prompt_len=3", "raise"]),
    "qa_file without a checkpoint": (["task.name=qa_file", "task.train_file=x.jsonl",
                                      "warm_start.steps=0"], ["needs policy.hf_checkpoint"]),
    "a checkpoint folder that does not exist": (["policy.hf_checkpoint=/no/such/model"],
                                                ["policy.hf_checkpoint='/no/such/model'", "no such folder"]),
    "an unknown key": (["rollout.temprature=1"], ["did you mean 'rollout.temperature'"]),
    "a layer_skip drafter as deep as the policy": (
        ["rollout.speculative=layer_skip", "rollout.speculative_exit_layer=2"],
        ["rollout.speculative_exit_layer=2", "1 .. 1"]),
    "layer_skip with another drafter": (["rollout.speculative=layer_skip,history"],
                                        ["cannot be combined"]),
    "techniques with no fill round": (["algorithm.techniques=dapo", "algorithm.fill_rounds=0"],
                                      ["algorithm.fill_rounds", ">= 1"]),
    "more held-out problems than exist": (["task.num_heldout=100000"], ["distinct problems"]),
    "a walk of no steps": (["task.max_steps=0"], ["task.max_steps=0"]),
    "a reward choice the task does not have": (["task.reward=final"],
                                                ["task.reward='final'", "count_walk"]),
    "a compile cache that cannot be a folder": (["compile_cache=/dev/null/xla"],
                                                ["compile_cache='/dev/null/xla'", "cannot create",
                                                 "compile_cache=''"]),
    "counted walks that cannot fit the budget": (["task.name=count_walk", "rollout.max_new_tokens=2",
                                                  "task.num_train=20", "task.num_heldout=4"],
                                             ["too few distinct problems fit"]),
}


@pytest.mark.parametrize("name", sorted(CONFIG_FACTS))
def test_config_facts_fail_in_one_line_before_jax(name, tmp_path):
  sets, fragments = CONFIG_FACTS[name]
  # A technique's hyperparameters are checked by building its transform:
  # that imports JAX, so that case runs with JAX allowed.
  rc, err = run_cli(*train_args(tmp_path, *sets), jax_allowed="techniques" in name)
  assert_one_line(rc, err, *fragments)
  assert not os.path.exists(tmp_path / "run"), "nothing is written for a bad config"


def test_a_config_file_with_a_syntax_error(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text("def get_config(:\n  pass\n")
  rc, err = run_cli("train", str(bad))
  assert_one_line(rc, err, f"{bad}:1: syntax error")


def test_run_folder_facts(tmp_path):
  rc, err = run_cli(*train_args(tmp_path), "--resume")
  assert_one_line(rc, err, "holds no run to resume", "drop --resume")
  cfg = config_lib.apply_overrides(config_lib.load(os.path.join(ROOT, "configs/quick.py")),
                                   SMALL + [f"run_dir={tmp_path / 'run'}"])
  fake_resumable_run(str(tmp_path / "run"), cfg)
  rc, err = run_cli(*train_args(tmp_path))
  assert_one_line(rc, err, "already holds a run (checkpoint at step 3)", "--resume")
  rc, err = run_cli(*train_args(tmp_path, "seed=5", "rl.learning_rate=0.5", "rollout.group_size=4"),
                    "--resume")
  assert_one_line(rc, err, "seed (run 0, now 5)", "rl.learning_rate (run 0.001, now 0.5)",
                  "rollout.group_size (run 8, now 4)")
  # Every checkpoint damaged and set aside: neither command touches the folder.
  os.makedirs(tmp_path / "run" / "checkpoints.set_aside")
  shutil.move(str(tmp_path / "run" / "checkpoints" / "3"), str(tmp_path / "run" / "checkpoints.set_aside"))
  for extra in ([], ["--resume"]):
    assert_one_line(*run_cli(*train_args(tmp_path), *extra), "no intact checkpoint left")
  assert (tmp_path / "run" / "config.json").exists()
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "notes.txt").write_text("mine")
  rc, err = run_cli(*train_args(tmp_path, f"run_dir={tmp_path / 'other'}"))
  assert_one_line(rc, err, "no jaxroll run")
  assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def _save_warm_start_fingerprint(src, *overrides):
  """A committed warm-start manifest in `src` as quick.py with `overrides` would write it."""
  cfg = config_lib.apply_overrides(config_lib.load(os.path.join(ROOT, "configs/quick.py")),
                                   SMALL + list(overrides))
  checkpoint_manifest.write_manifest(
      str(src / "0"), {"step": 0, "fingerprint": {"config": run_folder.warm_start_fingerprint(cfg)}})


def test_warm_start_from_a_run_with_another_seed(tmp_path):
  src = tmp_path / "ws"
  os.makedirs(src / "0")
  _save_warm_start_fingerprint(src, "seed=1")
  rc, err = run_cli(*train_args(tmp_path, f"warm_start.from_dir={src}"))
  assert_one_line(rc, err, "seed: checkpoint 1, this run 0")
  # The warm start's sequences (and a counted walk's vocabulary) follow the rollout budget.
  _save_warm_start_fingerprint(src, "rollout.max_new_tokens=20")
  rc, err = run_cli(*train_args(tmp_path, f"warm_start.from_dir={src}"))
  assert_one_line(rc, err, "rollout.max_new_tokens: checkpoint 20, this run 24")
  rc, err = run_cli(*train_args(tmp_path, f"warm_start.from_dir={tmp_path / 'none'}"))
  assert_one_line(rc, err, "holds no committed warm-started policy")


def test_qa_files_and_checkpoint_files(tmp_path):
  model = fake_hf_folder(tmp_path / "model")
  qa = ["task.name=qa_file", "warm_start.steps=0", f"policy.hf_checkpoint={model}"]
  good = '{"question": "1+1?", "answer": "2"}'
  cases = [
      ([good, "{not json"], ["qa.jsonl:2: invalid JSON", "on_bad_line='skip'"]),
      ([good, '{"question": "2+2?"}'], ["qa.jsonl:2: missing field(s) ['answer']"]),
  ]
  for lines, fragments in cases:
    rc, err = run_cli(*train_args(tmp_path, *qa, f"task.train_file={qa_file(tmp_path, lines)}"))
    assert_one_line(rc, err, *fragments)
  rc, err = run_cli(*train_args(tmp_path, *qa, f"task.train_file={tmp_path / 'missing.jsonl'}"))
  assert_one_line(rc, err, "missing.jsonl: no such dataset file")
  broken = fake_hf_folder(tmp_path / "broken", truncate=True)
  rc, err = run_cli(*train_args(tmp_path, "task.name=qa_file", "warm_start.steps=0",
                                f"policy.hf_checkpoint={broken}",
                                f"task.train_file={qa_file(tmp_path, [good])}"))
  assert_one_line(rc, err, "model.safetensors: truncated", "copy the checkpoint again")


def test_report_simulate_and_compare_on_a_missing_run(tmp_path):
  missing = str(tmp_path / "nothing")
  assert_one_line(*run_cli("report", missing, jax_allowed=True), "no config.json")
  assert_one_line(*run_cli("simulate", missing, "--workers", "8", jax_allowed=True), "no length trace")
  assert_one_line(*run_cli("compare", missing + ".py", "--variants", "grpo", "--target", "0.5",
                           "--out", str(tmp_path / "c"), jax_allowed=True), "no such config file")


def test_debug_shows_the_traceback(tmp_path):
  rc, err = run_cli(*train_args(tmp_path, "rollout.top_p=0"), "--debug")
  assert rc == 1 and "Traceback" in err and "ConfigError" in err
  rc, err = run_cli(*train_args(tmp_path, "rollout.top_p=0"), env={"JAXROLL_DEBUG": "1"})
  assert rc == 1 and "Traceback" in err
