"""The run's rollout engines and reward workers: the training sampler's,
and evaluation's when it cannot share them.

Evaluation always decodes plainly from the policy itself: held-out prompts
stay out of speculative drafts, accuracy is the policy's own rather than a
sparse cache's approximation or a behaviour model's, and with the rollout
thread running, evaluation gets its own engine and reward workers so the
two never share per-call state.
"""

from __future__ import annotations

import dataclasses

from jaxroll import config as config_lib
from jaxroll.model.paged_kv_cache import paged_from_config
from jaxroll.rollout import RolloutEngine
from jaxroll.rollout.speculative import spec_from_config
from jaxroll.tasks.rewards import RewardRunner


@dataclasses.dataclass
class Engines:
  train: RolloutEngine  # samples the training rollouts (the behaviour's model)
  eval: RolloutEngine  # samples held-out evaluation (the policy's model)
  rewards: RewardRunner
  eval_rewards: RewardRunner


def make_engine(cfg, tokenizer, sampling, rollout_mesh, model_cfg, graphdef,
                for_training: bool = True) -> RolloutEngine:
  """The training sampler's engine, or (for_training=False) a plain dense one."""
  r = cfg.rollout
  if for_training and r.kv_cache == "paged" and rollout_mesh is not None:
    raise config_lib.ConfigError("rollout.kv_cache=paged is not yet sharded over a device mesh "
                                 "(a multi-process run samples on one): use rollout.kv_cache=dense")
  return RolloutEngine(model_cfg, graphdef, num_slots=r.num_slots, max_prompt_len=r.max_prompt_len,
                       max_new_tokens=r.max_new_tokens, sampling=sampling,
                       stop_token_ids=tokenizer.eos_token_ids, mesh=rollout_mesh,
                       speculative=spec_from_config(r) if for_training else None,
                       history_per_prompt=r.speculative_history,
                       paged=paged_from_config(r) if for_training else None)


def make_engines(cfg, task, sampling, rollout_mesh, behaviour, model_cfg, graphdef) -> Engines:
  """`behaviour`: what samples the training rollouts (jaxroll.behaviour)."""
  r = cfg.rollout
  make = lambda mcfg, gdef, **kw: make_engine(cfg, task.tokenizer, sampling, rollout_mesh, mcfg, gdef, **kw)
  train = make(behaviour.model_cfg, behaviour.graphdef)
  rewards = RewardRunner(task.reward_fn, cfg.task.reward_timeout_s)
  sync = cfg.pipeline.mode == "sync"
  plain = behaviour.model_cfg == model_cfg and not r.speculative and r.kv_cache == "dense"
  if plain and sync:
    return Engines(train, train, rewards, rewards)
  evaluation = make(model_cfg, graphdef, for_training=False)
  eval_rewards = rewards if sync else RewardRunner(task.reward_fn, cfg.task.reward_timeout_s)
  return Engines(train, evaluation, rewards, eval_rewards)
