"""Experiment configuration: typed frozen dataclasses, one source of truth.

A config file in `configs/` is Python that defines `get_config()` returning
an `ExperimentConfig`; a run folder's `config.json` (the resolved config that
every run writes) loads the same way, so `jaxroll train RUN/config.json`
repeats a run. `--set section.key=value` overrides single fields; values are
parsed by the field's type, and an unknown key is an error that names the
closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import os
import typing
from typing import Any

from jaxroll.errors import JaxrollError
from jaxroll.rl.truncation import parse_budgets


class ConfigError(JaxrollError, ValueError):
  """A config file, key or value is invalid."""


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """Where prompts and rewards come from.

  name: "mod_walk" (built in, generated from `seed`: short walks), "count_walk"
    (built in: long, long-tailed chains over a fixed pool; jaxroll/tasks/
    count_walk.py) or "qa_file" (GSM8K/MATH-style JSONL or Parquet, rewarded
    with math-verify).
  count_walk: the number of steps per problem is log-normal with median
    walk_median and shape walk_sigma (larger: a heavier tail), redrawn when
    the response (2 tokens a step) would not fit rollout.max_new_tokens.
    reward: "chain" (the whole walk exact) or "final" (the last value and
    `#0` right). warm_walk_median: the warm start trains on problems drawn
    fresh from the generator (held-out prompts excluded) with this median
    number of steps and shape warm_walk_sigma; 0 trains on the pool itself.
  """

  name: str = "mod_walk"
  seed: int = 0
  num_train: int = 20000
  num_heldout: int = 256
  max_steps: int = 19  # mod_walk: the longest walk generated (1..19)
  walk_median: float = 48.0
  walk_sigma: float = 0.8
  warm_walk_median: float = 0.0
  warm_walk_sigma: float = 1.2
  reward: str = "chain"
  train_file: str = ""
  heldout_file: str = ""
  question_key: str = "question"
  answer_key: str = "answer"
  prompt_template: str = "{question}"
  on_bad_line: str = "error"  # or "skip" (skipped lines are counted in the run's data stats)
  reward_timeout_s: float = 5.0


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
  """The policy: a Hugging Face checkpoint folder, or a model from scratch."""

  hf_checkpoint: str = ""  # empty: build the shape below with the task's tokenizer
  hidden_size: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  mlp_dim: int = 512
  rope_theta: float = 10000.0
  param_dtype: str = "float32"
  dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
  """Supervised phase on generated worked solutions before RL (0 steps skips it)."""

  steps: int = 600
  batch_size: int = 64
  learning_rate: float = 5e-3
  warmup_steps: int = 50
  error_rate: float = 0.1  # chance that each written step is deliberately wrong
  # Token slots (rows x padded width) per micro-batch: the batch is split
  # into micro-batches whose gradients add up (the update is the batch's),
  # one shape per width (jaxroll/rl/buckets.py).
  microbatch_tokens: int = 512
  # A run's run_dir/warm_start folder: load that warm-started policy instead
  # of training it (same seed, task, policy and warm-start settings required).
  from_dir: str = ""


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  prompts_per_step: int = 16  # P
  group_size: int = 8  # G
  max_prompt_len: int = 8
  max_new_tokens: int = 24
  num_slots: int = 128
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  # The sampler's copy of the weights: "bfloat16" samples with rounded
  # weights against the float32 trainer (a rollout-training mismatch).
  param_dtype: str = "float32"
  # Speculative decoding of training rollouts (jaxroll.rollout.speculative):
  # the drafters, comma-separated from "history" (the prompt's earlier
  # responses; "global" adds a fallback window of recent responses to all
  # prompts) and "siblings" (the group's other rows), or "layer_skip"
  # alone (the policy's first speculative_exit_layer layers and its head
  # draft, LayerSkip-style); empty is off. Exact: the sampled distribution
  # is unchanged, only the speed differs.
  speculative: str = ""
  speculative_exit_layer: int = 1  # layers the layer_skip drafter runs
  speculative_k: int = 4  # most drafted tokens per row per pass
  speculative_adaptive: bool = True  # per-row draft length from recent acceptance
  speculative_history: int = 4  # earlier responses kept per prompt
  # The KV cache (jaxroll.model.paged_kv_cache): "dense" gives every slot
  # prompt + max_new_tokens positions; "paged" takes pages of kv_page_size
  # positions as rows grow, shares a group's prompt pages, and attends over
  # live pages only. kv_pages bounds the pool (0: every slot at full
  # length); with fewer, rows wait for pages and are preempted and resumed
  # when they run out. kv_sparsity "quest" or "streaming" attends over
  # kv_budget of a row's pages (plus kv_sink_pages and kv_recent_pages):
  # the sampler then draws from an approximation of the policy, and the
  # recorded behaviour log-probs are the approximation's (correct with
  # rl.off_policy; rl.measure_mismatch reports the gap).
  kv_cache: str = "dense"
  kv_page_size: int = 16
  kv_pages: int = 0
  kv_sparsity: str = "none"
  kv_budget: float = 0.25
  kv_sink_pages: int = 1
  kv_recent_pages: int = 1
  # Sparrow's controller (jaxroll/loop/kv_budget.py): after each update,
  # raise the budget by kv_budget_step when the 5th percentile of the
  # per-token sparse-dense agreement is below kv_budget_p5, lower it (not
  # under kv_budget) when above kv_budget_p5 + kv_budget_margin. 0: the
  # budget stays kv_budget. kv_budget_start is where the controlled budget
  # begins (rounded up to a step above kv_budget; 1 starts dense and lets
  # the agreement bring it down); 0 starts at kv_budget.
  kv_budget_p5: float = 0.0
  kv_budget_step: float = 0.125
  kv_budget_margin: float = 0.05
  kv_budget_start: float = 0.0


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
  """Long-tail rollout: admission order, partial rollout, truncation (survey 5.4-5.5, 6.3).

  order: "fifo" admits rows in launch order; "lpt" admits the longest
    predicted first (pure reordering: the same tokens, a shorter makespan
    when there are more rows than slots).
  predictor: for "lpt": "history" (each prompt's last `history_window`
    lengths, RhymeRL) or "sibling_probe" (one row per group first, its
    length for the siblings, Seer).
  sorted_batches: SortedRL-style length-sorted batching: > 0 draws this
    many batches of prompts ahead and serves the shortest predicted first.
    This changes which prompts share a step (a curriculum), unlike `order`.
  over_provision: APRIL: launch ceil(f * prompts_per_step) groups and stop
    decoding once prompts_per_step groups are complete (f >= 1; 1 = off).
    Unfinished rows are carried into the next step and resumed under the
    new weights (Kimi k1.5); no launched group is dropped.
  max_age: a carried row holding a token more than this many policy
    versions old is restarted from scratch.
  stale_tokens: how tokens sampled before the batch's rollout began (rows
    carried from earlier steps, replayed groups) enter the loss: "ppo"
    (importance ratio against their recorded behaviour log-prob, clipped
    as usual) or "mask" (left out). The lag of the weights the batch
    started with (pipeline.max_lag) is corrected by rl.off_policy either way.
  budgets: token budget curriculum "budget@step,..." (e.g. "12@0,24@100");
    empty: rollout.max_new_tokens throughout.
  truncation: keep | zero_reward | mask | drop (jaxroll.rl.truncation).
  """

  order: str = "fifo"
  predictor: str = "history"
  history_window: int = 4
  sorted_batches: int = 0
  over_provision: float = 1.0
  max_age: int = 4
  stale_tokens: str = "ppo"
  budgets: str = ""
  truncation: str = "keep"


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
  """The algorithmic lever (jaxroll.replay): which prompts get rollouts, how
  many, and which trajectories the update sees.

  techniques: a comma-separated chain applied in order, e.g. "greso,vigor";
    empty is uniform GRPO. Names: dapo, greso, mopps, kgps, vcrl, vigor, vip,
    pods, popo; "random_<name>" is <name>'s matched-rate random control.
  candidates: prompts drawn per planning round, as a multiple of
    rollout.prompts_per_step (filters choose among them).
  fill_rounds: planning rounds per step allowed to fill the batch when
    prompts are skipped (or, with dapo, groups dropped); the step trains on
    fewer groups if they run out, and says so in its metrics.
  max_samples: the most rollouts one prompt can get (vigor, vip; pods draws
    this many and keeps rollout.group_size). 0: 2 * rollout.group_size.
  budget: rollouts per step that vigor and vip allocate; 0: prompts_per_step
    * group_size, the uniform baseline's.
  The other keys are the techniques' hyperparameters (jaxroll/replay/*.py).
  """

  techniques: str = ""
  candidates: float = 2.0
  fill_rounds: int = 4
  max_samples: int = 0
  budget: int = 0
  greso_target: float = 0.25
  greso_step: float = 0.01
  greso_floor: float = 0.05
  mopps_target: float = 0.5
  mopps_decay: float = 0.9
  kgps_drift: float = 0.05
  vcrl_threshold: float = 0.3
  vcrl_replay: int = 0
  vigor_probes: int = 2
  vigor_round: int = 16
  vip_min: int = 2
  popo_buffer: int = 64  # groups the replay buffer holds
  popo_max_age: int = 4  # replay only groups sampled at most this many steps ago
  popo_decay: float = 0.5  # priority = reward variance * popo_decay ** age


@dataclasses.dataclass(frozen=True)
class RLConfig:
  advantage: str = "grpo"  # grpo | dr_grpo | rloo
  aggregation: str = "token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
  clip_low: float = 0.2
  clip_high: float = 0.2
  kl_coef: float = 0.0  # > 0 adds a k3 KL penalty against the warm-start policy
  minibatches: int = 1  # optimiser updates per rollout batch (PPO-style)
  # How tokens of another policy (older versions, the sampler's numerics)
  # are corrected (jaxroll/rl/losses.py): ppo (ratio against the recorded
  # behaviour log-probs, clipped) | tis (trust region around the update's
  # starting policy, behaviour weight truncated at is_cap) | decoupled (the
  # same, tokens above is_cap masked: AReaL) | sis (the same with one
  # truncated weight per sequence, the product of its tokens': unbiased
  # when untruncated) | aipo (truncated-ratio policy gradient: LlamaRL).
  # popo with "ppo" trains with "tis".
  off_policy: str = "ppo"
  is_cap: float = 2.0
  # Recompute the sampled tokens' log-probs at the start of each update and
  # report their distance to the sampler's (mismatch_*): one forward pass.
  measure_mismatch: bool = True
  # Sparse-RL's rejection: drop from the loss every row with a token, sampled
  # by the weights being updated, whose |trainer - sampler| log-prob gap
  # exceeds this (an anomalous rollout, e.g. from a sparse KV cache); 0: off.
  mismatch_reject: float = 0.0
  # The update takes its gradient over chunks of this many token slots
  # (rows x padded width, longest rows first), summed: the same update at
  # about the cost of the batch's tokens, compiled once per width
  # (jaxroll/rl/buckets.py, jaxroll/rl/chunked_update.py). Smaller chunks
  # pad less; 512 is the fastest on the default task on CPU (a large
  # model on an accelerator wants several thousand). 0: one array at the
  # longest row's width. Multi-process runs use the one array.
  microbatch_tokens: int = 512
  # With the chunked update and no KL term: take no gradient over rows whose
  # advantage is exactly 0 (degenerate groups), which contribute exactly 0
  # to it. The same update for what the rows with a signal cost; the token
  # means of the update statistics (clip_fraction, ratio_mean) then cover
  # those rows only. False: every row, as the one-array update.
  skip_zero_advantage: bool = True
  learning_rate: float = 1e-3
  warmup_steps: int = 10
  end_lr_ratio: float = 0.1  # cosine decay to learning_rate * end_lr_ratio
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  b1: float = 0.9
  b2: float = 0.99


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """Overlap of rollout and training (jaxroll.pipeline; survey 5.2, 6.3).

  mode "sync": sample step t's batch, then update (on-policy).
  mode "async": a rollout thread samples ahead with the newest published
    weights, at most max_lag versions behind the update that uses them
    (max_lag=1 is one-step off-policy: batch t+1 is sampled while update t
    runs). Correct the lag with rl.off_policy (tis, decoupled, aipo).
  mode "interrupt": as async, and a batch still decoding when new weights
    are published stops, and its unfinished rows resume under the new
    weights (AReaL); a trajectory may then span versions, each token
    keeping its own version and behaviour log-prob. interrupt_every is the
    most decode steps between checks for new weights.
  """

  mode: str = "sync"
  max_lag: int = 1
  interrupt_every: int = 4


@dataclasses.dataclass(frozen=True)
class BehaviourConfig:
  """Which policy samples the training rollouts (jaxroll/behaviour/).

  kind "policy": the policy itself (on-policy).
  kind "nested": Nested-ReFT, a subset of the policy's layers: layer_fraction
    of them kept (at least one), the first and last always when keep_ends,
    the rest re-drawn per policy version (layer_schedule "per_step") or
    drawn once ("fixed"); correct with rl.off_policy (sis, tis, ...).
  kind "r2po": the policy plus a residual rollout head trained on rarity
    advantages at head_learning_rate, initialised from N(0, head_init_std^2).
  Evaluation always samples from the policy alone.
  """

  kind: str = "policy"
  layer_fraction: float = 0.5
  layer_schedule: str = "per_step"
  keep_ends: bool = True
  head_learning_rate: float = 1e-3
  head_init_std: float = 1e-6


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device placement (jaxroll.sharding).

  placement "colocated": rollout and training share one data x fsdp x tensor
    mesh over all devices, time-sliced. The default 1x1x1 runs on the first
    device without placement.
  placement "disaggregated": the first `rollout_devices` devices form the
    rollout mesh (data parallel over decode slots); the training mesh
    (data x fsdp x tensor) takes the rest. Publishing weights is then a
    measured transfer between the meshes (weight_sync_bytes / _s).
  One of data / fsdp / tensor may be -1 to take the remaining devices.
  """

  placement: str = "colocated"
  data: int = 1
  fsdp: int = 1
  tensor: int = 1
  rollout_devices: int = 0


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """One training run. `steps` counts RL steps (one rollout batch each)."""

  seed: int = 0
  steps: int = 150
  run_dir: str = "runs/default"
  eval_every: int = 25
  eval_samples: int = 4  # samples per held-out prompt for held-out accuracy
  checkpoint_every: int = 10
  keep_checkpoints: int = 2
  tensorboard: bool = True
  report: bool = True
  progress: bool = True
  # A folder for JAX's persistent compilation cache ('' = off): later
  # processes load the programs earlier ones compiled (jaxroll.compile_cache).
  compile_cache: str = ""
  task: TaskConfig = TaskConfig()
  policy: PolicyConfig = PolicyConfig()
  warm_start: WarmStartConfig = WarmStartConfig()
  rollout: RolloutConfig = RolloutConfig()
  rl: RLConfig = RLConfig()
  schedule: ScheduleConfig = ScheduleConfig()
  algorithm: AlgorithmConfig = AlgorithmConfig()
  pipeline: PipelineConfig = PipelineConfig()
  behaviour: BehaviourConfig = BehaviourConfig()
  mesh: MeshConfig = MeshConfig()

  def __post_init__(self):
    validate(self)


_CHOICES = {
    "task.name": ("mod_walk", "count_walk", "qa_file"),
    "task.reward": ("chain", "final"),
    "task.on_bad_line": ("error", "skip"),
    "rl.advantage": ("grpo", "dr_grpo", "rloo"),
    "rl.aggregation": ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"),
    "rl.off_policy": ("ppo", "tis", "decoupled", "sis", "aipo"),
    "policy.param_dtype": ("float32", "bfloat16"),
    "rollout.param_dtype": ("float32", "bfloat16"),
    "policy.dtype": ("float32", "bfloat16"),
    "mesh.placement": ("colocated", "disaggregated"),
    "schedule.order": ("fifo", "lpt"),
    "pipeline.mode": ("sync", "async", "interrupt"),
    "schedule.predictor": ("history", "sibling_probe"),
    "schedule.stale_tokens": ("ppo", "mask"),
    "schedule.truncation": ("keep", "zero_reward", "mask", "drop"),
    "behaviour.kind": ("policy", "nested", "r2po"),
    "behaviour.layer_schedule": ("per_step", "fixed"),
    "rollout.kv_cache": ("dense", "paged"),
    "rollout.kv_sparsity": ("none", "quest", "streaming"),
}
_POSITIVE = ("steps", "eval_every", "eval_samples", "checkpoint_every", "keep_checkpoints",
             "task.num_train", "task.num_heldout", "task.reward_timeout_s",
             "rollout.prompts_per_step", "rollout.max_prompt_len", "rollout.max_new_tokens",
             "rollout.num_slots", "rl.minibatches", "rl.learning_rate", "warm_start.batch_size",
             "schedule.history_window", "task.walk_median",
             "warm_start.microbatch_tokens")


def _validate_speculative(cfg: ExperimentConfig) -> None:
  r = cfg.rollout
  if not r.speculative:
    return
  names = [n.strip() for n in r.speculative.split(",")]
  unknown = sorted(set(names) - {"history", "global", "siblings", "layer_skip"})
  if unknown or not names:
    raise ConfigError(f"rollout.speculative={r.speculative!r}: drafters are 'history' and "
                      f"'siblings' (comma-separated, 'global' adding the history's fallback over "
                      f"all prompts) or 'layer_skip', unknown {unknown}")
  if "global" in names and "history" not in names:
    raise ConfigError(f"rollout.speculative={r.speculative!r}: 'global' is the history drafter's "
                      "fallback over all prompts; add 'history'")
  if "layer_skip" in names:
    if len(set(names)) > 1:
      raise ConfigError(f"rollout.speculative={r.speculative!r}: the layer_skip drafter cannot be "
                        "combined with history or siblings yet; use it alone")
    layers = cfg.policy.num_layers
    if r.speculative_exit_layer < 1:
      raise ConfigError(f"rollout.speculative_exit_layer={r.speculative_exit_layer} must be >= 1")
    # A checkpoint's depth is checked by jaxroll.preflight, from its config.json.
    if not cfg.policy.hf_checkpoint and r.speculative_exit_layer >= layers:
      raise ConfigError(f"rollout.speculative_exit_layer={r.speculative_exit_layer}: the layer_skip "
                        f"drafter runs a proper prefix of the policy's {layers} layers, so 1 .. {layers - 1}")
    if cfg.behaviour.kind == "nested":
      raise ConfigError("rollout.speculative=layer_skip with behaviour.kind=nested: the behaviour "
                        "model already skips layers and drafting from its prefix is not built yet; "
                        "turn one off")
  if r.speculative_k < 1 or r.speculative_history < 1:
    raise ConfigError(f"rollout.speculative_k and rollout.speculative_history must be >= 1, "
                      f"got {r.speculative_k} and {r.speculative_history}")
  if cfg.behaviour.kind == "r2po":
    raise ConfigError("rollout.speculative with behaviour.kind=r2po: the rollout head's "
                      "distribution is not verified by the speculative step yet; turn one off")


def _validate_kv_cache(cfg: ExperimentConfig) -> None:
  r, m = cfg.rollout, cfg.mesh
  _validate_kv_budget_control(cfg)
  if r.kv_cache == "dense":
    if r.kv_sparsity != "none":
      raise ConfigError(f"rollout.kv_sparsity={r.kv_sparsity!r} selects pages of a paged cache: "
                        "set rollout.kv_cache=paged")
    return
  if r.kv_page_size < 1 or r.kv_pages < 0:
    raise ConfigError(f"rollout.kv_page_size must be >= 1 and rollout.kv_pages >= 0, "
                      f"got {r.kv_page_size} and {r.kv_pages}")
  if not 0.0 < r.kv_budget <= 1.0 or r.kv_sink_pages < 0 or r.kv_recent_pages < 1:
    raise ConfigError("rollout.kv_budget must be in (0, 1], rollout.kv_sink_pages >= 0 and "
                      f"rollout.kv_recent_pages >= 1, got {r.kv_budget}, {r.kv_sink_pages}, "
                      f"{r.kv_recent_pages}")
  full_row = -(-(r.max_prompt_len + r.max_new_tokens + (r.speculative_k if r.speculative else 0))
               // r.kv_page_size)
  if r.kv_pages and r.kv_pages < full_row:
    raise ConfigError(f"rollout.kv_pages={r.kv_pages} cannot hold one full row ({full_row} pages of "
                      f"{r.kv_page_size}); raise it to at least {full_row}, or 0 for every slot")
  if m.placement != "colocated" or (m.data, m.fsdp, m.tensor) != (1, 1, 1):
    raise ConfigError("rollout.kv_cache=paged is not yet sharded over a device mesh (its page pool "
                      "is shared by all slots): use rollout.kv_cache=dense with a mesh")


def _validate_kv_budget_control(cfg: ExperimentConfig) -> None:
  r = cfg.rollout
  if r.kv_budget_p5 == 0.0:
    if r.kv_budget_start != 0.0:
      raise ConfigError("rollout.kv_budget_start is where Sparrow's controller starts the budget: "
                        "set rollout.kv_budget_p5 too, or rollout.kv_budget_start=0")
    return
  if r.kv_budget_start != 0.0 and not r.kv_budget <= r.kv_budget_start <= 1.0:
    raise ConfigError(f"rollout.kv_budget_start must be 0 (start at rollout.kv_budget) or in "
                      f"[rollout.kv_budget, 1] = [{r.kv_budget}, 1], got {r.kv_budget_start}")
  if r.kv_budget_start > r.kv_budget and r.kv_budget_p5 + r.kv_budget_margin >= 1.0:
    # The agreement is at most 1, so the budget could never fall from its start.
    raise ConfigError(f"rollout.kv_budget_start={r.kv_budget_start} above the floor needs "
                      "rollout.kv_budget_p5 + rollout.kv_budget_margin < 1, or the budget never "
                      f"falls: got {r.kv_budget_p5} + {r.kv_budget_margin}")
  if not 0.0 < r.kv_budget_p5 < 1.0 or not 0.0 < r.kv_budget_step <= 1.0 or r.kv_budget_margin < 0.0:
    raise ConfigError("rollout.kv_budget_p5 must be in (0, 1) (0 turns the controller off), "
                      "rollout.kv_budget_step in (0, 1] and rollout.kv_budget_margin >= 0, got "
                      f"{r.kv_budget_p5}, {r.kv_budget_step}, {r.kv_budget_margin}")
  if r.kv_sparsity == "none":
    raise ConfigError("rollout.kv_budget_p5 controls a sparse page budget: set rollout.kv_sparsity "
                      "to quest or streaming, or rollout.kv_budget_p5=0")
  if not cfg.rl.measure_mismatch:
    raise ConfigError("rollout.kv_budget_p5 reads each step's sparse-dense agreement: set "
                      "rl.measure_mismatch=true")


def _validate_behaviour(cfg: ExperimentConfig) -> None:
  b, r = cfg.behaviour, cfg.rollout
  if b.kind == "nested" and not 0.0 < b.layer_fraction <= 1.0:
    raise ConfigError(f"behaviour.layer_fraction must be in (0, 1], got {b.layer_fraction}")
  if b.kind == "r2po":
    if r.temperature == 0.0 or r.top_k or r.top_p < 1.0:
      raise ConfigError("behaviour.kind=r2po samples from the full softmax (the policy would give "
                        "the head's tokens probability 0 under top-k/top-p, and greedy has no "
                        "log-probs): set rollout.temperature > 0, rollout.top_k=0, rollout.top_p=1")
    if not b.head_learning_rate > 0 or not b.head_init_std >= 0:
      raise ConfigError(f"behaviour.head_learning_rate must be > 0 and behaviour.head_init_std >= 0, "
                        f"got {b.head_learning_rate} and {b.head_init_std}")


def validate(cfg: ExperimentConfig) -> None:
  flat = to_flat_dict(cfg)
  for key, allowed in _CHOICES.items():
    if flat[key] not in allowed:
      raise ConfigError(f"{key}={flat[key]!r} is not one of {allowed}")
  for key in _POSITIVE:
    if not flat[key] > 0:
      raise ConfigError(f"{key} must be positive, got {flat[key]}")
  _validate_sampling(cfg)
  _validate_policy(cfg)
  _validate_task(cfg)
  _validate_behaviour(cfg)
  _validate_speculative(cfg)
  _validate_kv_cache(cfg)
  if cfg.rollout.group_size < 2:
    raise ConfigError(f"rollout.group_size must be >= 2 for group-relative advantages, "
                      f"got {cfg.rollout.group_size}")
  n = cfg.rollout.prompts_per_step * cfg.rollout.group_size
  if n % cfg.rl.minibatches:
    raise ConfigError(f"rl.minibatches={cfg.rl.minibatches} must divide the {n} trajectories "
                      f"per step (prompts_per_step * group_size)")
  if not cfg.rl.mismatch_reject >= 0.0:
    raise ConfigError(f"rl.mismatch_reject must be >= 0 (0 turns the rejection off), "
                      f"got {cfg.rl.mismatch_reject}")
  if not cfg.rl.is_cap >= 1.0:
    raise ConfigError(f"rl.is_cap must be >= 1 (a cap below 1 would down-weight on-policy tokens), "
                      f"got {cfg.rl.is_cap}")
  if cfg.task.name == "qa_file" and not cfg.task.train_file:
    raise ConfigError("task.name='qa_file' needs task.train_file")
  if cfg.warm_start.steps and cfg.task.name == "qa_file":
    raise ConfigError("warm_start generates worked solutions only for the built-in tasks; "
                      "set warm_start.steps=0 for a qa_file task")
  if (cfg.mesh.placement == "disaggregated") != (cfg.mesh.rollout_devices > 0):
    raise ConfigError("mesh.rollout_devices must be > 0 exactly when mesh.placement='disaggregated' "
                      f"(got placement={cfg.mesh.placement!r}, rollout_devices={cfg.mesh.rollout_devices})")
  sch = cfg.schedule
  if not sch.over_provision >= 1.0:
    raise ConfigError(f"schedule.over_provision must be >= 1 (launch at least the groups an "
                      f"update needs), got {sch.over_provision}")
  if sch.max_age < 0:
    raise ConfigError(f"schedule.max_age must be >= 0 policy versions, got {sch.max_age}")
  if sch.sorted_batches < 0:
    raise ConfigError(f"schedule.sorted_batches must be >= 0, got {sch.sorted_batches}")
  if cfg.rl.microbatch_tokens < 0:
    raise ConfigError(f"rl.microbatch_tokens must be >= 0 (0: the update takes the batch as one "
                      f"array), got {cfg.rl.microbatch_tokens}")
  try:
    parse_budgets(sch.budgets, cfg.rollout.max_new_tokens)
  except ValueError as e:
    raise ConfigError(f"schedule.budgets={sch.budgets!r}: {e}") from None
  _validate_algorithm(cfg)
  _validate_pipeline(cfg)
  if not 0.0 <= cfg.warm_start.error_rate < 1.0:
    raise ConfigError(f"warm_start.error_rate must be in [0, 1), got {cfg.warm_start.error_rate}")


def _validate_sampling(cfg: ExperimentConfig) -> None:
  r = cfg.rollout
  if not r.temperature >= 0.0:
    raise ConfigError(f"rollout.temperature must be >= 0 (0 samples greedily), got {r.temperature}")
  if r.top_k < 0:
    raise ConfigError(f"rollout.top_k must be >= 0 (0 keeps every token), got {r.top_k}")
  if not 0.0 < r.top_p <= 1.0:
    raise ConfigError(f"rollout.top_p must be in (0, 1] (1 keeps every token), got {r.top_p}")


def _validate_task(cfg: ExperimentConfig) -> None:
  from jaxroll.tasks.mod_walk import MODULUS  # NumPy only

  t = cfg.task
  if t.name == "mod_walk" and not 1 <= t.max_steps < MODULUS:
    raise ConfigError(f"task.max_steps={t.max_steps}: a modular walk has 1 to {MODULUS - 1} steps")
  if t.reward != "chain" and t.name != "count_walk":
    raise ConfigError(f"task.reward={t.reward!r} applies to task.name='count_walk' only "
                      f"({t.name!r} has one reward); drop the setting")
  if t.name == "count_walk" and not t.warm_walk_median >= 0:
    raise ConfigError(f"task.warm_walk_median must be >= 0 (0: the warm start trains on the pool), "
                      f"got {t.warm_walk_median}")
  for key in ("walk_sigma", "warm_walk_sigma"):
    if t.name == "count_walk" and not getattr(t, key) >= 0:
      raise ConfigError(f"task.{key} must be >= 0 (0: every problem has the median number of "
                        f"steps), got {getattr(t, key)}")


def _validate_policy(cfg: ExperimentConfig) -> None:
  # With policy.hf_checkpoint the shape comes from the checkpoint's own
  # config.json; files and folders are checked by jaxroll.preflight.
  p = cfg.policy
  if p.hf_checkpoint:
    return
  for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "mlp_dim"):
    if not getattr(p, key) > 0:
      raise ConfigError(f"policy.{key} must be positive, got {getattr(p, key)}")
  if p.num_heads % p.num_kv_heads:
    raise ConfigError(f"policy.num_heads={p.num_heads} must be a multiple of "
                      f"policy.num_kv_heads={p.num_kv_heads} (grouped-query attention)")
  if p.hidden_size % p.num_heads or (p.hidden_size // p.num_heads) % 2:
    raise ConfigError(f"policy.hidden_size={p.hidden_size} must split into policy.num_heads="
                      f"{p.num_heads} heads of an even size (rotary embeddings)")


def _validate_pipeline(cfg: ExperimentConfig) -> None:
  p = cfg.pipeline
  if p.max_lag < 0:
    raise ConfigError(f"pipeline.max_lag must be >= 0 policy versions, got {p.max_lag}")
  if p.interrupt_every < 1:
    raise ConfigError(f"pipeline.interrupt_every must be >= 1 decode step, got {p.interrupt_every}")


def _validate_algorithm(cfg: ExperimentConfig) -> None:
  # Imported here: the registry imports jax, which a config check should not need up front.
  from jaxroll.replay.registry import check_techniques

  try:
    check_techniques(cfg)
  except ValueError as e:
    raise ConfigError(str(e)) from None


# -- flat views, overrides and files -----------------------------------------

def to_flat_dict(cfg) -> dict[str, Any]:
  out = {}
  for f in dataclasses.fields(cfg):
    v = getattr(cfg, f.name)
    if dataclasses.is_dataclass(v):
      out.update({f"{f.name}.{k}": x for k, x in to_flat_dict(v).items()})
    else:
      out[f.name] = v
  return out


def flat_differences(a: dict[str, Any], b: dict[str, Any], a_name: str, b_name: str,
                     ignore=()) -> list[str]:
  """One "key: <a_name> value, <b_name> value" line per key of two flat
  config dicts whose values differ (a key missing on one side is None)."""
  return [f"{k}: {a_name} {a.get(k)!r}, {b_name} {b.get(k)!r}" for k in sorted(set(a) | set(b))
          if k not in ignore and a.get(k) != b.get(k)]


def to_dict(cfg) -> dict[str, Any]:
  return dataclasses.asdict(cfg)


def _field_types(cls) -> dict[str, Any]:
  hints = typing.get_type_hints(cls)
  out = {}
  for f in dataclasses.fields(cls):
    t = hints[f.name]
    if dataclasses.is_dataclass(t):
      out.update({f"{f.name}.{k}": v for k, v in _field_types(t).items()})
    else:
      out[f.name] = t
  return out


def _parse(key: str, text: str, typ):
  try:
    if typ is bool:
      low = text.lower()
      if low not in ("true", "false", "1", "0"):
        raise ValueError(text)
      return low in ("true", "1")
    return typ(text)
  except ValueError:
    raise ConfigError(f"{key}={text!r}: expected a {typ.__name__}") from None


def _unknown(key: str, valid) -> ConfigError:
  close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.0)
  hint = f"; did you mean {close[0]!r}?" if close else ""
  return ConfigError(f"unknown config key {key!r}{hint}")


def from_flat_dict(flat: dict[str, Any], base: ExperimentConfig | None = None) -> ExperimentConfig:
  """Builds a config from {"section.key": value}, over `base` (defaults when None)."""
  types = _field_types(ExperimentConfig)
  merged = to_flat_dict(base or ExperimentConfig())
  for key, value in flat.items():
    if key not in types:
      raise _unknown(key, types)
    typ = types[key]
    if isinstance(value, str) and typ is not str:
      value = _parse(key, value, typ)
    elif typ is float and isinstance(value, int) and not isinstance(value, bool):
      value = float(value)
    elif not isinstance(value, typ):
      raise ConfigError(f"{key}={value!r}: expected a {typ.__name__}")
    merged[key] = value
  sections: dict[str, dict] = {}
  top = {}
  for key, value in merged.items():
    if "." in key:
      sec, name = key.split(".", 1)
      sections.setdefault(sec, {})[name] = value
    else:
      top[key] = value
  hints = typing.get_type_hints(ExperimentConfig)
  for sec, values in sections.items():
    top[sec] = hints[sec](**values)
  return ExperimentConfig(**top)


def apply_overrides(cfg: ExperimentConfig, overrides: list[str]) -> ExperimentConfig:
  """Applies ["section.key=value", ...] (the CLI's --set)."""
  flat = {}
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"--set expects key=value, got {item!r}")
    key, value = item.split("=", 1)
    flat[key.strip()] = value
  return from_flat_dict(flat, cfg)


def _flatten_nested(d: dict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flatten_nested(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def load(path: str) -> ExperimentConfig:
  """Loads a configs/*.py file (its get_config()) or a run's config.json."""
  if not os.path.isfile(path):
    raise ConfigError(f"{path}: no such config file")
  if path.endswith(".json"):
    with open(path) as f:
      try:
        return from_flat_dict(_flatten_nested(json.load(f)))
      except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
  if not path.endswith(".py"):
    raise ConfigError(f"{path}: a config is a .py file with get_config() or a run's config.json")
  spec = importlib.util.spec_from_file_location("jaxroll_config", path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except SyntaxError as e:
    raise ConfigError(f"{path}:{e.lineno}: syntax error ({e.msg}); fix the config file") from None
  except ConfigError:
    raise
  except Exception as e:  # the file is user code: whatever it raises is a config problem
    raise ConfigError(f"{path}: loading it raised {type(e).__name__}: {e}") from None
  if not hasattr(module, "get_config"):
    raise ConfigError(f"{path} defines no get_config()")
  try:
    cfg = module.get_config()
  except ConfigError:
    raise
  except Exception as e:
    raise ConfigError(f"{path}: get_config() raised {type(e).__name__}: {e}") from None
  if not isinstance(cfg, ExperimentConfig):
    raise ConfigError(f"{path}: get_config() returned {type(cfg).__name__}, not ExperimentConfig")
  return cfg
