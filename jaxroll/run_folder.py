"""A run folder's lifecycle: what state it is in, and how a start treats it.

The state is read from the folder itself, never from memory of the last
command:
  empty       the folder is absent or empty: `jaxroll train` starts the run.
  unstarted   config.json is there but no checkpoint was ever committed (the
              run was stopped during start-up, the warm start or its first
              evaluation): the same command, with or without --resume,
              starts it again. A committed warm start whose config matches is
              kept and reused; everything else the attempt wrote is removed.
  resumable   a committed checkpoint exists: --resume continues from the
              newest intact one; the plain command refuses (nothing is
              overwritten).
  damaged     no committed checkpoint is left but damaged ones were set
              aside: refused either way, and nothing is touched (its logs
              hold completed steps that no checkpoint can resume).
  foreign     files that are not a jaxroll run: refused either way.
`run_state.json` records what the run was last doing (informational; the
decision above never reads it). Resuming checks the whole config against
the run's: only the keys in SAFE_ON_RESUME may change, and each change is
recorded in run_info.json's "resumes" list (config.json stays as written).

This module imports neither JAX nor orbax: every check runs before JAX starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

from jaxroll import checkpoint_manifest as manifest
from jaxroll import config as config_lib
from jaxroll.errors import JaxrollError

# Keys that change how long a run goes and what it records, not what a
# step computes. `steps` also stretches the cosine learning-rate schedule
# from the resumed step on (rl.optim), which is why changes are recorded.
SAFE_ON_RESUME = ("steps", "eval_every", "checkpoint_every", "keep_checkpoints", "progress",
                  "report", "tensorboard", "compile_cache")


class RunFolderError(JaxrollError, ValueError):
  """The run folder cannot be used as asked."""


@dataclasses.dataclass(frozen=True)
class StartPlan:
  """How `train` treats the run folder: "fresh", "restart" or "resume"."""

  mode: str
  checkpoint_step: int | None = None
  changes: dict[str, list[Any]] = dataclasses.field(default_factory=dict)


def checkpoints_dir(run_dir: str) -> str:
  return os.path.join(run_dir, "checkpoints")


def warm_start_dir(run_dir: str) -> str:
  return os.path.join(run_dir, "warm_start")


def warm_start_fingerprint(cfg: config_lib.ExperimentConfig) -> dict[str, Any]:
  """The config keys the warm-started policy depends on: a saved one is
  reused only by a run that would have trained the same. The rollout
  lengths count: they bound the warm start's sequences, and the counted
  walk sizes its problems and its counter vocabulary by them."""
  flat = config_lib.to_flat_dict(cfg)
  return {k: v for k, v in flat.items()
          if (k.split(".")[0] in ("seed", "task", "policy", "warm_start") and k != "warm_start.from_dir")
          or k in ("rollout.max_prompt_len", "rollout.max_new_tokens")}


def state(run_dir: str) -> str:
  """"empty", "unstarted", "resumable", "damaged" or "foreign" (see the module docstring)."""
  if not os.path.isdir(run_dir) or not os.listdir(run_dir):
    return "empty"
  if manifest.committed_steps(checkpoints_dir(run_dir)):
    return "resumable"
  aside = checkpoints_dir(run_dir) + ".set_aside"
  if os.path.isdir(aside) and os.listdir(aside):
    return "damaged"
  if os.path.isfile(os.path.join(run_dir, "config.json")):
    return "unstarted"
  return "foreign"


def plan_start(cfg: config_lib.ExperimentConfig, resume: bool) -> StartPlan:
  """Decides how a start treats cfg.run_dir; changes nothing on disk.

  Raises:
    RunFolderError: --resume with no run there, a plain start over a run
      with checkpoints, a folder of other files, or a resume whose config
      differs in keys outside SAFE_ON_RESUME.
  """
  run_dir = cfg.run_dir
  st = state(run_dir)
  if st == "foreign":
    raise RunFolderError(f"{run_dir} holds files but no jaxroll run (no config.json); "
                         "choose another run_dir (nothing was overwritten)")
  if st == "damaged":
    raise RunFolderError(f"{run_dir} has no intact checkpoint left (the damaged ones are in "
                         f"{checkpoints_dir(run_dir)}.set_aside); its files are kept as they are; "
                         "start the run again in a new run_dir")
  if st == "empty":
    if resume:
      raise RunFolderError(f"--resume: {run_dir} holds no run to resume; drop --resume to start it")
    return StartPlan("fresh")
  if st == "unstarted":
    return StartPlan("restart")
  step = manifest.committed_steps(checkpoints_dir(run_dir))[-1]
  if not resume:
    raise RunFolderError(f"{run_dir} already holds a run (checkpoint at step {step}); pass --resume "
                         "to continue it, or choose another run_dir (nothing was overwritten)")
  return StartPlan("resume", step, config_changes(cfg))


def effective_config(run_dir: str) -> config_lib.ExperimentConfig:
  """The config the run is running under: config.json plus the changes its resumes recorded."""
  base = config_lib.load(os.path.join(run_dir, "config.json"))
  changed = {}
  for entry in _read_json(os.path.join(run_dir, "run_info.json")).get("resumes", []):
    changed.update({k: new for k, (_, new) in entry.get("changed", {}).items()})
  return config_lib.from_flat_dict(changed, base) if changed else base


def config_changes(cfg: config_lib.ExperimentConfig) -> dict[str, list[Any]]:
  """{key: [run's value, this config's]} for the keys a resume changes.

  Raises:
    RunFolderError: naming every differing key outside SAFE_ON_RESUME.
  """
  old = config_lib.to_flat_dict(effective_config(cfg.run_dir))
  new = config_lib.to_flat_dict(cfg)
  diff = {k: [old.get(k), new[k]] for k in new if k != "run_dir" and old.get(k) != new[k]}
  refused = sorted(k for k in diff if k not in SAFE_ON_RESUME)
  if refused:
    named = ", ".join(f"{k} (run {diff[k][0]!r}, now {diff[k][1]!r})" for k in refused)
    raise RunFolderError(f"--resume: the config differs from the run's in {named}; resume with "
                         f"{os.path.join(cfg.run_dir, 'config.json')} (only "
                         f"{', '.join(SAFE_ON_RESUME)} may change) or use a new run_dir")
  return diff


def prepare(cfg: config_lib.ExperimentConfig, plan: StartPlan) -> None:
  """Makes the folder ready for `plan` (the main process only)."""
  run_dir = cfg.run_dir
  os.makedirs(run_dir, exist_ok=True)
  if plan.mode != "restart":
    return
  keep = set()
  ws = warm_start_dir(run_dir)
  steps = manifest.committed_steps(ws)
  if steps:
    saved = manifest.read_meta(ws, steps[-1]).get("fingerprint", {}).get("config")
    if saved == warm_start_fingerprint(cfg):
      keep = {"warm_start", "warm_start.jsonl"}  # complete: written before its commit
  for name in os.listdir(run_dir):
    if name in keep:
      continue
    path = os.path.join(run_dir, name)
    shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)


def record_resume(run_dir: str, plan: StartPlan, commit: str) -> None:
  """Appends this resume (step, changed keys, source commit) to run_info.json."""
  path = os.path.join(run_dir, "run_info.json")
  info = _read_json(path)
  info.setdefault("resumes", []).append(
      {"from_step": plan.checkpoint_step, "changed": plan.changes, "git_commit": commit})
  write_json_atomic(path, info)


def write_state(run_dir: str, phase: str, **fields: Any) -> None:
  """run_state.json: "starting", "warm_start", "training", "stopped" or "finished"."""
  write_json_atomic(os.path.join(run_dir, "run_state.json"), {"state": phase, **fields})


def write_json_atomic(path: str, obj: Any) -> None:
  with open(path + ".tmp", "w") as f:
    json.dump(obj, f, indent=2)
  os.replace(path + ".tmp", path)


def _read_json(path: str) -> dict[str, Any]:
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise RunFolderError(f"{path}: not valid JSON ({e.msg}); restore it or use a new run_dir") from None
