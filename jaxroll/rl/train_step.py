"""The RL update: trajectories -> packed batch -> clipped-surrogate step(s).

`pack` runs on the host and lays a batch out at one of a few static widths
(`padded_width`), so the jitted update compiles a handful of times and a
batch of short responses is not padded to the longest possible one.
`make_update` returns that update; `rl.chunked_update` is the same update
over length chunks of the rows, for batches of very uneven length.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxroll.rl.buckets import padded_width  # noqa: F401  (re-exported)
from jaxroll.rl.losses import (OFF_POLICY, PROXIMAL, aipo_loss, decoupled_ppo_loss, kl_penalty, mismatch_rejection,
                               mismatch_stats,
                               ppo_clipped_loss)
from jaxroll.rl.policy_logp import next_token_logp
from jaxroll.rollout.sampling import SamplingParams
from jaxroll.types import Trajectories


class RLBatch(NamedTuple):
  """N rows of prompt + completion, right-padded to a fixed T.

  Index t of the [N, T] arrays refers to token t: `loss_mask` marks the
  generated tokens that enter the loss, `behaviour_logp` holds their
  sampling log-probs, and `current_NxT` marks the generated tokens sampled
  by the weights the update starts from (where the sampler and the trainer
  should agree exactly: the rollout-training mismatch is measured there).
  """

  tokens_NxT: np.ndarray
  loss_mask_NxT: np.ndarray
  behaviour_logp_NxT: np.ndarray
  adv_N: np.ndarray
  current_NxT: np.ndarray


def pack(prompts: Sequence[Sequence[int]], traj: Trajectories, adv_N, seq_len: int,
         in_loss_NxL=None, version: int | None = None) -> RLBatch:
  """Lays trajectories out for the update (row n's prompt is prompts[n // G]).

  Args:
    in_loss_NxL: optional bool mask of generated tokens that enter the loss
      (a truncation or staleness treatment); default: all of them.
    version: the policy version of the weights the update starts from;
      None: every generated token counts as sampled by them.
  """
  N, L = traj.tokens_NxL.shape
  keep_NxL = traj.mask_NxL if in_loss_NxL is None else traj.mask_NxL & np.asarray(in_loss_NxL, bool)
  tokens = np.zeros((N, seq_len), np.int32)
  mask = np.zeros((N, seq_len), bool)
  blogp = np.zeros((N, seq_len), np.float32)
  current = np.zeros((N, seq_len), bool)
  current_NxL = traj.mask_NxL if version is None else traj.mask_NxL & (traj.version_NxL == version)
  for n in range(N):
    prompt = prompts[int(traj.prompt_index_N[n])]
    p, g = len(prompt), int(traj.length_N[n])
    if p + g > seq_len:
      raise ValueError(f"row {n}: {p} prompt + {g} generated tokens exceed seq_len={seq_len}")
    tokens[n, :p] = prompt
    tokens[n, p:p + g] = traj.tokens_NxL[n, :g]
    mask[n, p:p + g] = keep_NxL[n, :g]
    blogp[n, p:p + g] = traj.logp_NxL[n, :g]
    current[n, p:p + g] = current_NxL[n, :g]
  return RLBatch(tokens, mask, blogp, np.asarray(adv_N, np.float32), current)


def rl_loss(params, graphdef, batch: RLBatch, ref_params, proximal_logp_NxT=None, *,
            sampling: SamplingParams, clip_low: float, clip_high: float, aggregation: str,
            kl_coef: float, off_policy: str = "ppo", is_cap: float = 2.0, max_len: int | None = None,
            weight_NxT=None):
  """The policy loss `off_policy` names (plus the KL penalty).

  "ppo": ratio against the recorded behaviour log-probs, clipped.
  "tis" / "decoupled": the decoupled objective around `proximal_logp_NxT`
  (log-probs under the parameters at the start of the update, tokens
  1..T-1), behaviour weights truncated (tis) or masked (decoupled) at is_cap.
  "sis": the same with one truncated weight per row, the product of its
  tokens' (losses.decoupled_ppo_loss, level="sequence").
  "aipo": truncated-ratio policy gradient, no clip.
  `max_len`: the constant of seq_mean_token_sum_norm (losses.aggregate).
  `weight_NxT`: per-token weights over tokens 1..T-1 (losses.token_weights
  of the whole batch) in place of `aggregation`, for a chunk of its rows.
  """
  logp_NxT = next_token_logp(graphdef, params, batch.tokens_NxT, sampling)
  mask_NxT = batch.loss_mask_NxT[:, 1:]
  # Keep padding finite: -inf * 0 would poison the sums.
  logp_NxT = jnp.where(mask_NxT, logp_NxT, 0.0)
  behaviour_NxT = batch.behaviour_logp_NxT[:, 1:]
  if off_policy == "ppo":
    loss, stats = ppo_clipped_loss(logp_NxT, behaviour_NxT, batch.adv_N, mask_NxT,
                                   clip_low=clip_low, clip_high=clip_high, aggregation=aggregation,
                                   max_len=max_len, weight_NxL=weight_NxT)
  elif off_policy == "aipo":
    loss, stats = aipo_loss(logp_NxT, behaviour_NxT, batch.adv_N, mask_NxT, is_cap=is_cap,
                            aggregation=aggregation, max_len=max_len, weight_NxL=weight_NxT)
  else:
    loss, stats = decoupled_ppo_loss(
        logp_NxT, jnp.where(mask_NxT, proximal_logp_NxT, 0.0), behaviour_NxT, batch.adv_N, mask_NxT,
        clip_low=clip_low, clip_high=clip_high, is_cap=is_cap,
        cap="mask" if off_policy == "decoupled" else "truncate", aggregation=aggregation,
        max_len=max_len, weight_NxL=weight_NxT, level="sequence" if off_policy == "sis" else "token")
  if ref_params is not None:
    ref_NxT = jax.lax.stop_gradient(next_token_logp(graphdef, ref_params, batch.tokens_NxT, sampling))
    kl = kl_penalty(logp_NxT, jnp.where(mask_NxT, ref_NxT, 0.0), mask_NxT, aggregation, max_len,
                    weight_NxT)
    loss = loss + kl_coef * kl
    stats = dict(stats, kl=kl)
  return loss, dict(stats, loss=loss)


def make_update(graphdef, tx: optax.GradientTransformation, *, sampling: SamplingParams,
                minibatches: int, clip_low: float, clip_high: float, aggregation: str,
                kl_coef: float, off_policy: str = "ppo", is_cap: float = 2.0,
                measure_mismatch: bool = False, state_shardings=None, max_len: int | None = None,
                mismatch_reject: float = 0.0):
  """A jitted (params, opt_state, batch, ref_params) -> (params, opt_state, stats).

  With `state_shardings = (param_shardings, opt_state_shardings)` the new
  parameters and optimiser state come out in the same layout as they went in
  (inputs are placed by the caller; jit propagates their shardings).

  The N rows are split into `minibatches` consecutive slices, one optimiser
  update each (one slice is the on-policy GRPO step; more reuse the batch
  PPO-style, and the clipped ratio then bounds how far each update moves).

  `max_len`: the constant length seq_mean_token_sum_norm divides by (give
  it when batches come at several padded widths).

  `off_policy` picks the loss (`rl_loss`). "tis" and "decoupled" first
  compute the proximal log-probs of the whole batch under the incoming
  parameters (one extra forward pass); so does `measure_mismatch`, which
  compares them with the sampler's on the tokens those same weights sampled
  (`batch.current_NxT`) and adds `mismatch_stats` to the step's stats.
  `mismatch_reject` > 0 drops from the loss every row with such a token
  whose log-prob gap exceeds it (`losses.mismatch_rejection`), counted in
  `mismatch_rejected_rows`.
  """
  if off_policy not in OFF_POLICY:
    raise ValueError(f"unknown rl.off_policy {off_policy!r}; expected one of {OFF_POLICY}")
  loss_fn = functools.partial(rl_loss, graphdef=graphdef, sampling=sampling, off_policy=off_policy,
                              clip_low=clip_low, clip_high=clip_high, aggregation=aggregation,
                              kl_coef=kl_coef, is_cap=is_cap, max_len=max_len)
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def update(params, opt_state, batch: RLBatch, ref_params):
    N = batch.adv_N.shape[0]
    size = N // minibatches
    prox_NxT = None
    if off_policy in PROXIMAL or measure_mismatch or mismatch_reject > 0:
      prox_NxT = jax.lax.stop_gradient(next_token_logp(graphdef, params, batch.tokens_NxT, sampling))
    rejected = None
    if mismatch_reject > 0:
      keep_N = mismatch_rejection(prox_NxT, batch.behaviour_logp_NxT[:, 1:], batch.current_NxT[:, 1:],
                                  mismatch_reject)
      rejected = jnp.sum(~keep_N & jnp.any(batch.loss_mask_NxT, axis=1))
      batch = batch._replace(loss_mask_NxT=jnp.where(keep_N[:, None], batch.loss_mask_NxT,
                                                     jnp.zeros_like(batch.loss_mask_NxT)))
    all_stats = []
    for m in range(minibatches):
      rows = lambda x: x[m * size:(m + 1) * size]
      part = jax.tree.map(rows, batch)
      prox = None if prox_NxT is None else rows(prox_NxT)
      (_, stats), grads = grad_fn(params, batch=part, ref_params=ref_params, proximal_logp_NxT=prox)
      stats["grad_norm"] = optax.tree.norm(grads)
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      all_stats.append(stats)
    stats = jax.tree.map(lambda *x: jnp.mean(jnp.stack(x)), *all_stats)
    if measure_mismatch:
      stats.update(mismatch_stats(prox_NxT, batch.behaviour_logp_NxT[:, 1:], batch.current_NxT[:, 1:]))
    if rejected is not None:
      stats["mismatch_rejected_rows"] = rejected
    return params, opt_state, stats

  # The old parameters and optimiser state are replaced: donating them lets
  # XLA update in place instead of holding two copies.
  out_shardings = None if state_shardings is None else (*state_shardings, None)
  return jax.jit(update, donate_argnums=(0, 1), out_shardings=out_shardings)
