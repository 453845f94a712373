"""Builds the transform chain a config names (`algorithm.techniques`).

One entry per technique: its factory, called with the config's
hyperparameters, and the level at which its random control matches it.
The transform modules (and so JAX) are imported only when a chain is
built or checked: validating a config without techniques stays JAX-free.
"""

from __future__ import annotations

import difflib
import math

NAMES = ("dapo", "greso", "mopps", "kgps", "vcrl", "vigor", "vip", "pods", "popo")
# Techniques whose matched-rate control is their own rule with a random
# criterion: replay (which slots may be drawn is popo's rule) and allocation
# (a control must spend the rollouts the technique spends, not P x G).
_OWN_CONTROL = ("popo", "vigor", "vip")
# Techniques that give a prompt more than rollout.group_size rollouts.
_WIDE = ("vigor", "vip", "pods")


def technique_names(cfg) -> list[str]:
  return [n.strip() for n in cfg.algorithm.techniques.split(",") if n.strip()]


def base_name(name: str) -> str:
  """The technique a name stands for: `random_<name>` controls `<name>`."""
  return name[len("random_"):] if name.startswith("random_") else name


def base_names(cfg) -> set[str]:
  """The techniques named, each random control as the technique it controls."""
  return {base_name(n) for n in technique_names(cfg)}


def max_samples(cfg) -> int:
  return cfg.algorithm.max_samples or 2 * cfg.rollout.group_size


def rows_per_group(cfg) -> int:
  """S, the rows an update holds per group: max_samples when a technique
  can give a prompt more than group_size rollouts, else group_size."""
  return max_samples(cfg) if base_names(cfg) & set(_WIDE) else cfg.rollout.group_size


def buffer_groups(cfg) -> int:
  """Capacity of the replay buffer: popo's, else none is kept."""
  return cfg.algorithm.popo_buffer if "popo" in base_names(cfg) else 0


def off_policy_loss(cfg) -> str:
  """rl.off_policy, except that replayed groups are off-policy: popo turns
  plain "ppo" into "tis", its decoupled importance-sampling objective."""
  if cfg.rl.off_policy == "ppo" and "popo" in base_names(cfg):
    return "tis"
  return cfg.rl.off_policy


def budget(cfg) -> int:
  return cfg.algorithm.budget or cfg.rollout.prompts_per_step * cfg.rollout.group_size


def _factory(name: str, cfg, random: bool = False):
  from jaxroll.replay import allocation, filtering, reuse, selection

  a, r = cfg.algorithm, cfg.rollout
  P, G = r.prompts_per_step, r.group_size
  if name == "dapo":
    return selection.drop_zero_variance_groups()
  if name == "greso":
    return filtering.greso(target=a.greso_target, step=a.greso_step, floor=a.greso_floor)
  if name == "mopps":
    return filtering.mopps(num_keep=P, target=a.mopps_target, decay=a.mopps_decay)
  if name == "kgps":
    return filtering.kgps(num_keep=P, group_size=G, drift=a.kgps_drift)
  if name == "vcrl":
    return filtering.vcrl(threshold=a.vcrl_threshold, replay_slots=a.vcrl_replay)
  if name == "vigor":
    return allocation.vigor(budget(cfg), probes=a.vigor_probes, round_size=a.vigor_round,
                            max_per_prompt=max_samples(cfg), random=random)
  if name == "vip":
    return allocation.vip(budget(cfg), n_min=a.vip_min, n_max=max_samples(cfg), random=random)
  if name == "pods":
    return selection.pods(keep=G)
  if name == "popo":
    return reuse.popo(max_age=a.popo_max_age, decay=a.popo_decay, random=random)
  raise AssertionError(name)


def build(cfg):
  """The chain (a RolloutTransform) of `algorithm.techniques`; identity when empty."""
  from jaxroll.replay import controls
  from jaxroll.replay.protocol import chain, identity

  parts = []
  for name in technique_names(cfg):
    base = base_name(name)
    if base in _OWN_CONTROL:
      parts.append(_factory(base, cfg, random=name != base))
      continue
    t = _factory(base, cfg)
    parts.append(controls.random_control(t) if name != base else t)
  return chain(*parts) if parts else identity()


def refills_after_select(cfg) -> bool:
  """DAPO's dynamic sampling (and its control) keeps sampling until the batch is full."""
  return any(n in ("dapo", "random_dapo") for n in technique_names(cfg))


def draws_max_samples(cfg) -> bool:
  """PODS draws max_samples per prompt and keeps group_size of them."""
  return any(n in ("pods", "random_pods") for n in technique_names(cfg))


def check_techniques(cfg) -> None:
  """Raises ValueError naming the first invalid technique or hyperparameter."""
  a, r = cfg.algorithm, cfg.rollout
  for name in technique_names(cfg):
    base = base_name(name)
    if base not in NAMES:
      close = difflib.get_close_matches(base, NAMES, n=1)
      hint = f"; did you mean {close[0]!r}?" if close else ""
      raise ValueError(f"algorithm.techniques: unknown technique {name!r}{hint} "
                       f"(known: {', '.join(NAMES)}, each also as random_<name>)")
  if not technique_names(cfg):
    return
  if not a.candidates >= 1.0:
    raise ValueError(f"algorithm.candidates must be >= 1, got {a.candidates}")
  if a.fill_rounds < 1:
    raise ValueError(f"algorithm.fill_rounds must be >= 1, got {a.fill_rounds}")
  if a.budget < 0 or a.max_samples < 0:
    raise ValueError(f"algorithm.budget and algorithm.max_samples must be >= 0 "
                     f"(0 picks the default), got {a.budget} and {a.max_samples}")
  if max_samples(cfg) < r.group_size:
    raise ValueError(f"algorithm.max_samples={a.max_samples} is below rollout.group_size={r.group_size}")
  K = math.ceil(a.candidates * r.prompts_per_step)
  if budget(cfg) > K * max_samples(cfg):
    raise ValueError(f"algorithm.budget={budget(cfg)} exceeds what {K} candidate prompts x "
                     f"{max_samples(cfg)} samples can take")
  rows = r.prompts_per_step * rows_per_group(cfg)
  if rows % cfg.rl.minibatches:
    raise ValueError(f"rl.minibatches={cfg.rl.minibatches} must divide the {rows} rows of a planned "
                     f"step (prompts_per_step x rows per group)")
  if "popo" in base_names(cfg) and a.popo_buffer < 1:
    raise ValueError(f"algorithm.popo_buffer must be >= 1 group, got {a.popo_buffer}")
  for name in technique_names(cfg):
    base = base_name(name)
    try:
      _factory(base, cfg)  # each factory validates its hyperparameters
    except ValueError as e:
      raise ValueError(f"algorithm.techniques={name}: {e} (see the algorithm.{base}_* keys)") from None
