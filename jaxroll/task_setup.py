"""Builds a run's task (tokenizer, examples, reward) and policy from its config."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from jaxroll.config import ConfigError, ExperimentConfig
from jaxroll.errors import JaxrollError
from jaxroll.tasks.base import Example, RewardFn


@dataclasses.dataclass
class TaskBundle:
  """A task's tokenizer, examples and reward (`build_task` imports no JAX);
  jaxroll.preflight fills in the tokenized prompts."""

  tokenizer: Any
  train: list[Example]
  heldout: list[Example]
  reward_fn: RewardFn
  data_stats: dict[str, Any]
  # Built-in tasks: (prompt, rng, error_rate) -> a worked solution with
  # deliberate slips, for the supervised warm start.
  worked_solution: Callable[[str, Any, float], str] | None = None
  # The warm start's problems when they are not `train` (None: train).
  warm_start_examples: list[Example] | None = None
  train_tokens: list[list[int]] | None = None
  heldout_tokens: list[list[int]] | None = None


def build_task(cfg: ExperimentConfig) -> TaskBundle:
  """The task `cfg.task` names; a generated task that the config's sizes
  cannot produce is a ConfigError."""
  try:
    return _build_task(cfg)
  except ValueError as e:
    if isinstance(e, JaxrollError):
      raise
    raise ConfigError(f"task.name={cfg.task.name!r}: {e}") from None


def _build_task(cfg: ExperimentConfig) -> TaskBundle:
  t = cfg.task
  if t.name == "mod_walk":
    from jaxroll.tasks import mod_walk

    train, heldout = mod_walk.splits(t.seed, t.num_train, t.num_heldout, t.max_steps)
    return TaskBundle(mod_walk.tokenizer(), train, heldout, mod_walk.reward,
                      {"train_rows": len(train), "heldout_rows": len(heldout)},
                      lambda prompt, rng, e: mod_walk.worked_solution(mod_walk.parse_problem(prompt), rng, e))
  if t.name == "count_walk":
    from jaxroll.tasks import count_walk

    budget = cfg.rollout.max_new_tokens - 1  # room for EOS
    shape = dict(median=t.walk_median, sigma=t.walk_sigma, max_tokens=budget)
    train, heldout = count_walk.splits(t.seed, t.num_train, t.num_heldout, **shape)
    reward = count_walk.chain_reward if t.reward == "chain" else count_walk.final_reward
    warm = None
    if t.warm_walk_median and cfg.warm_start.steps:
      # One fresh problem per warm-start row.
      warm = count_walk.warm_start_examples(
          t.seed + 1, cfg.warm_start.steps * cfg.warm_start.batch_size, [e.prompt for e in heldout],
          **{**shape, "median": t.warm_walk_median, "sigma": t.warm_walk_sigma})
    return TaskBundle(count_walk.tokenizer(count_walk.max_steps(budget)), train, heldout, reward,
                      {"train_rows": len(train), "heldout_rows": len(heldout)},
                      lambda prompt, rng, e: count_walk.worked_solution(count_walk.parse_problem(prompt), rng, e),
                      warm_start_examples=warm)
  from jaxroll.model.tokenizer import Tokenizer
  from jaxroll.tasks.math_files import load_qa_file, math_verify_reward

  # math-verify logs a warning per call when its own timeouts are off; the
  # RewardRunner enforces the timeout instead.
  logging.getLogger("math_verify").setLevel(logging.ERROR)
  kw = dict(question_key=t.question_key, answer_key=t.answer_key,
            prompt_template=t.prompt_template, on_bad_line=t.on_bad_line)
  train_stats, heldout_stats = {}, {}
  train = load_qa_file(t.train_file, stats=train_stats, **kw)[:t.num_train]
  heldout_file = t.heldout_file or t.train_file
  heldout = load_qa_file(heldout_file, stats=heldout_stats, **kw)[:t.num_heldout]
  stats = {"train_rows": len(train), "heldout_rows": len(heldout),
           "train_skipped_lines": train_stats["skipped_lines"],
           "heldout_skipped_lines": heldout_stats["skipped_lines"]}
  if not t.heldout_file:
    logging.getLogger(__name__).warning(
        "task.heldout_file is empty: held-out accuracy is measured on train rows")
  return TaskBundle(Tokenizer.from_folder(cfg.policy.hf_checkpoint), train, heldout,
                    math_verify_reward, stats)


def build_policy(cfg: ExperimentConfig, tokenizer):
  """(model config, graphdef, params): a Hugging Face checkpoint or a fresh model."""
  from flax import nnx

  from jaxroll.model import ModelConfig, Transformer

  p = cfg.policy
  if p.hf_checkpoint:
    from jaxroll.model.hf_import import load_hf_model

    model = load_hf_model(p.hf_checkpoint, param_dtype=p.param_dtype, dtype=p.dtype)
  else:
    mcfg = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=p.hidden_size,
                       num_layers=p.num_layers, num_heads=p.num_heads,
                       num_kv_heads=p.num_kv_heads, mlp_dim=p.mlp_dim, rope_theta=p.rope_theta,
                       max_position=cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens,
                       param_dtype=p.param_dtype, dtype=p.dtype)
    model = Transformer(mcfg, rngs=nnx.Rngs(cfg.seed))
  graphdef, params = nnx.split(model)
  return model.cfg, graphdef, params
