"""Experiment configs: files, overrides, validation, and the error messages."""

import json
import subprocess
import sys

import pytest

from jaxroll import config as config_lib
from jaxroll.config import ConfigError, ExperimentConfig

ROOT = __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__)))


def test_overrides_are_typed():
  cfg = config_lib.apply_overrides(ExperimentConfig(), [
      "rl.learning_rate=3e-4", "steps=7", "tensorboard=false", "task.name=mod_walk",
      "rollout.temperature=1"])
  assert cfg.rl.learning_rate == 3e-4 and cfg.steps == 7 and cfg.tensorboard is False
  assert isinstance(cfg.rollout.temperature, float)


def test_unknown_key_names_the_closest_valid_key():
  with pytest.raises(ConfigError, match=r"unknown config key 'rl.learning_rat'.*'rl.learning_rate'"):
    config_lib.apply_overrides(ExperimentConfig(), ["rl.learning_rat=1e-3"])
  with pytest.raises(ConfigError, match=r"'rollout.group_size'"):
    config_lib.from_flat_dict({"rollout.groupsize": 4})


def test_bad_values_are_named():
  with pytest.raises(ConfigError, match="steps='many': expected a int"):
    config_lib.apply_overrides(ExperimentConfig(), ["steps=many"])
  with pytest.raises(ConfigError, match="rl.advantage='ppo' is not one of"):
    config_lib.apply_overrides(ExperimentConfig(), ["rl.advantage=ppo"])
  with pytest.raises(ConfigError, match="group_size must be >= 2"):
    config_lib.apply_overrides(ExperimentConfig(), ["rollout.group_size=1"])
  with pytest.raises(ConfigError, match="must divide"):
    config_lib.apply_overrides(ExperimentConfig(), ["rl.minibatches=3"])
  with pytest.raises(ConfigError, match="key=value"):
    config_lib.apply_overrides(ExperimentConfig(), ["steps"])


def test_resolved_json_round_trips(tmp_path):
  cfg = config_lib.apply_overrides(config_lib.load(f"{ROOT}/configs/default.py"), ["seed=3"])
  path = tmp_path / "config.json"
  path.write_text(json.dumps(config_lib.to_dict(cfg)))
  assert config_lib.load(str(path)) == cfg


def test_every_shipped_config_loads():
  import glob

  files = sorted(glob.glob(f"{ROOT}/configs/*.py"))
  assert len(files) >= 2
  for f in files:
    cfg = config_lib.load(f)
    assert isinstance(cfg, ExperimentConfig)


def test_cli_reports_config_errors_without_a_traceback():
  out = subprocess.run([sys.executable, "-m", "jaxroll.cli", "train", "configs/default.py",
                        "--set", "rl.clip_hihg=0.3"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 2
  assert "unknown config key 'rl.clip_hihg'; did you mean 'rl.clip_high'?" in out.stderr
  assert "Traceback" not in out.stderr
