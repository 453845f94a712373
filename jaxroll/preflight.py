"""Checks of a run's inputs that need files but not JAX, run before any work.

`check(cfg)` builds the task (a generated one, or the QA files with the
checkpoint's tokenizer), tokenizes its prompts and checks that they fit,
checks the Hugging Face checkpoint's files (a truncated safetensors file
is named), that `warm_start.from_dir` was written by a compatible config
and that `compile_cache` names a folder it can write. Each problem is a
JaxrollError naming the file or key and the fix.
"""

from __future__ import annotations

import glob
import json
import os

from jaxroll import checkpoint_manifest as manifest
from jaxroll import compile_cache
from jaxroll import config as config_lib
from jaxroll import run_folder
from jaxroll.model import safetensors_io
from jaxroll.task_setup import TaskBundle, build_task


def check(cfg: config_lib.ExperimentConfig) -> TaskBundle:
  """The run's task with its prompts tokenized, once every input checked out."""
  _check_policy_files(cfg)
  _check_warm_start_source(cfg)
  compile_cache.check(cfg.compile_cache)
  task = build_task(cfg)
  tok = task.tokenizer
  task.train_tokens = [tok.encode(e.prompt) for e in task.train]
  task.heldout_tokens = [tok.encode(e.prompt) for e in task.heldout]
  limit = cfg.rollout.max_prompt_len
  for split, prompts in (("train", task.train_tokens), ("held-out", task.heldout_tokens)):
    too_long = [i for i, p in enumerate(prompts) if len(p) > limit]
    if too_long:
      i = too_long[0]
      raise config_lib.ConfigError(
          f"{len(too_long)} {split} prompts exceed rollout.max_prompt_len={limit} tokens "
          f"(first: row {i}, {len(prompts[i])} tokens); raise rollout.max_prompt_len rather "
          "than dropping rows")
  return task


def _check_policy_files(cfg: config_lib.ExperimentConfig) -> None:
  folder = cfg.policy.hf_checkpoint
  if cfg.task.name == "qa_file" and not folder:
    raise config_lib.ConfigError("task.name='qa_file' needs policy.hf_checkpoint (its tokenizer "
                                 "encodes the text); set it to a Hugging Face model folder")
  if not folder:
    return
  if not os.path.isdir(folder):
    raise config_lib.ConfigError(f"policy.hf_checkpoint={folder!r}: no such folder (a Hugging Face "
                                 "model folder with config.json and *.safetensors)")
  if not os.path.isfile(os.path.join(folder, "config.json")):
    raise config_lib.ConfigError(f"policy.hf_checkpoint={folder!r} has no config.json")
  files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
  if not files:
    raise config_lib.ConfigError(f"policy.hf_checkpoint={folder!r} has no *.safetensors file")
  for path in files:
    safetensors_io.check_complete(path)
  _check_exit_layer(cfg, os.path.join(folder, "config.json"))


def _check_exit_layer(cfg: config_lib.ExperimentConfig, config_json: str) -> None:
  """The layer_skip drafter against the checkpoint's depth (config.py checks
  it against policy.num_layers when there is no checkpoint)."""
  r = cfg.rollout
  if "layer_skip" not in r.speculative:
    return
  with open(config_json) as f:
    layers = json.load(f).get("num_hidden_layers")
  if isinstance(layers, int) and r.speculative_exit_layer >= layers:
    raise config_lib.ConfigError(
        f"rollout.speculative_exit_layer={r.speculative_exit_layer}: the checkpoint has {layers} "
        f"layers and the layer_skip drafter runs a proper prefix of them, so 1 .. {layers - 1}")


def _check_warm_start_source(cfg: config_lib.ExperimentConfig) -> None:
  src = cfg.warm_start.from_dir
  if not src:
    return
  steps = manifest.committed_steps(src)
  if not steps:
    raise config_lib.ConfigError(f"warm_start.from_dir={src!r} holds no committed warm-started "
                                 "policy (a finished run's run_dir/warm_start)")
  saved = manifest.read_meta(src, steps[-1]).get("fingerprint", {})
  # Parameter shapes follow from these keys; the restore checks them again.
  manifest.check_fingerprint(saved, {"config": run_folder.warm_start_fingerprint(cfg)}, src)
