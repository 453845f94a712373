"""The RL update over length chunks of a batch's rows, gradients summed.

A reasoning batch holds responses from tens to hundreds of tokens; laid
out at its longest row (`train_step.make_update`), most of the update's
compute is padding and its attention is quadratic in that width. Here the
rows of each minibatch are split by `buckets.length_chunks`, each chunk's
gradient is taken at its own width, the gradients are summed and one
optimiser update follows: the same update as `make_update` on the same
batch (the loss is normalised over the whole minibatch by
`losses.token_weights`, so chunk losses add up to it), at about the cost
of the tokens themselves.

Statistics are combined as the whole batch's would be: token-weighted
means, maxima, sums, and the effective sample size from its sums.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxroll.rl.buckets import Chunk, length_chunks
from jaxroll.rl.losses import OFF_POLICY, PROXIMAL, mismatch_rejection, mismatch_stats, token_weights
from jaxroll.rl.optim import add_gradients
from jaxroll.rl.policy_logp import next_token_logp
from jaxroll.rl.train_step import RLBatch, rl_loss
from jaxroll.rollout.sampling import SamplingParams

# How each statistic of `rl_loss` / `mismatch_stats` combines over chunks.
_TOKEN_MEANS = ("clip_fraction", "ratio_mean", "is_weight_mean", "is_capped_fraction")
_SUMS = ("loss", "kl")
_MAXIMA = ("is_weight_max",)
_MISMATCH_MEANS = ("mismatch_abs_mean", "mismatch_kl")


def combine_loss_stats(parts: Sequence[tuple[dict, float]]) -> dict:
  """The statistics of a minibatch from those of its chunks, each with its
  count of loss tokens. is_ess = (sum w)^2 / (n sum w^2) is rebuilt from
  each chunk's sum w = is_weight_mean * n and sum w^2 = (sum w)^2 / (n is_ess)."""
  if len(parts) == 1:
    return {k: float(v) for k, v in parts[0][0].items()}
  n = sum(c for _, c in parts)
  out = {}
  for key in parts[0][0]:
    values = [float(s[key]) for s, _ in parts]
    if key in _SUMS:
      out[key] = sum(values)
    elif key in _MAXIMA:
      out[key] = max(values)
    elif key in _TOKEN_MEANS:
      out[key] = sum(v * c for v, (_, c) in zip(values, parts)) / max(n, 1.0)
    elif key == "is_ess":
      s1 = [float(s["is_weight_mean"]) * c for s, c in parts]
      s2 = [a * a / (c * float(s["is_ess"])) for a, (s, c) in zip(s1, parts)
            if c > 0 and float(s["is_ess"]) > 0]
      # <= 1 by Cauchy-Schwarz; the clip removes rounding from the rebuild.
      out[key] = min(1.0, sum(s1) ** 2 / max(max(n, 1.0) * sum(s2), 1e-30))
    else:
      raise ValueError(f"no rule to combine the update statistic {key!r} over chunks")
  return out


def combine_mismatch_stats(parts: Sequence[dict], agreements: Sequence[np.ndarray]) -> dict:
  """`losses.mismatch_stats` of a batch from those of its chunks; the
  agreement percentile from the chunks' per-token agreements (NaN where
  not measured), since percentiles do not combine."""
  n = [float(s["mismatch_tokens"]) for s in parts]
  out = {"mismatch_tokens": sum(n), "mismatch_max": max(float(s["mismatch_max"]) for s in parts)}
  for key in _MISMATCH_MEANS:
    out[key] = sum(float(s[key]) * c for s, c in zip(parts, n)) / max(sum(n), 1.0)
  values = np.concatenate([np.asarray(a).reshape(-1) for a in agreements])
  values = values[~np.isnan(values)]
  out["mismatch_agreement_p5"] = float(np.percentile(values, 5)) if values.size else 1.0
  return out


def _chunk_arrays(batch: RLBatch, weight_NxT: np.ndarray, chunk: Chunk):
  """Rows `chunk.rows` of the batch at `chunk.width`, padded with empty rows."""
  pad = chunk.num_rows - len(chunk.rows)

  def take(x):
    x = np.asarray(x)[chunk.rows]
    if x.ndim == 2:
      x = x[:, :chunk.width]
    return np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)]) if pad else x

  return RLBatch(*(take(x) for x in batch)), take(weight_NxT)[:, :chunk.width - 1]


def _take_rows(x_NxT: np.ndarray, chunk: Chunk, width: int) -> np.ndarray:
  """Rows `chunk.rows` of a host array at `width` columns, padded with zero rows."""
  x = x_NxT[chunk.rows, :width]
  pad = chunk.num_rows - len(chunk.rows)
  return np.concatenate([x, np.zeros((pad, width), x.dtype)]) if pad else x


def make_chunked_update(graphdef, tx: optax.GradientTransformation, *, sampling: SamplingParams,
                        minibatches: int, clip_low: float, clip_high: float, aggregation: str,
                        kl_coef: float, off_policy: str = "ppo", is_cap: float = 2.0,
                        measure_mismatch: bool = False, max_len: int | None = None,
                        mismatch_reject: float = 0.0,
                        microbatch_tokens: int = 512, row_multiple: int = 1, min_width: int = 32,
                        skip_zero_advantage: bool = False,
                        place: Callable = lambda rows: rows, state_shardings=None):
  """An (params, opt_state, batch, ref_params, lengths_N) -> (params, opt_state, stats)
  that updates as `train_step.make_update` with the same arguments.

  `batch` is packed on the host at any width that holds its rows;
  `lengths_N` are the rows' token counts (prompt + generated). `place`
  puts a chunk (a pytree of row-major arrays: the RLBatch and its token
  weights) on the devices (a mesh's batch sharding); `row_multiple`
  rounds each chunk's rows up to what that sharding divides; `min_width`
  is the narrowest chunk.

  `skip_zero_advantage`: without a KL reference, take no gradient over rows
  whose advantage is exactly 0 or that have no loss token (their every term
  is 0): the same update at the cost of the rows with a learning signal.
  Their statistics then leave the token means (clip_fraction, ratio_mean,
  the importance weights); `gradient_rows` counts the rows run.
  """
  if off_policy not in OFF_POLICY:
    raise ValueError(f"unknown rl.off_policy {off_policy!r}; expected one of {OFF_POLICY}")
  loss_fn = functools.partial(rl_loss, graphdef=graphdef, sampling=sampling, off_policy=off_policy,
                              clip_low=clip_low, clip_high=clip_high, aggregation=aggregation,
                              kl_coef=kl_coef, is_cap=is_cap, max_len=max_len)
  chunk_grad = jax.jit(jax.value_and_grad(
      lambda params, batch, weight, prox, ref: loss_fn(params, batch=batch, ref_params=ref,
                                                       proximal_logp_NxT=prox, weight_NxT=weight),
      has_aux=True))

  @jax.jit
  def proximal(params, batch: RLBatch):
    logp = jax.lax.stop_gradient(next_token_logp(graphdef, params, batch.tokens_NxT, sampling))
    behaviour, current = batch.behaviour_logp_NxT[:, 1:], batch.current_NxT[:, 1:]
    agreement = jnp.where(current, jnp.exp(-jnp.abs(logp - behaviour)), jnp.nan)
    keep = mismatch_rejection(logp, behaviour, current, mismatch_reject)
    rejected = jnp.sum(~keep & jnp.any(batch.loss_mask_NxT, axis=1))
    return logp, mismatch_stats(logp, behaviour, current), agreement, keep, rejected

  out_shardings = None if state_shardings is None else (*state_shardings, None)

  @functools.partial(jax.jit, donate_argnums=(0, 1), out_shardings=out_shardings)
  def apply(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)

  needs_prox = off_policy in PROXIMAL or measure_mismatch or mismatch_reject > 0
  # The mismatch statistics and the rejection look at every row; the
  # proximal log-probs alone are needed only where a gradient is taken.
  forward_all = measure_mismatch or mismatch_reject > 0

  def update(params, opt_state, batch: RLBatch, ref_params, lengths_N):
    lengths_N = np.asarray(lengths_N)
    N = lengths_N.shape[0]
    size = N // minibatches
    loss_mask = np.asarray(batch.loss_mask_NxT[:, 1:])
    minibatch_rows = [np.arange(m * size, (m + 1) * size) for m in range(minibatches)]

    def weights(keep_N):
      """Token weights of each minibatch over the rows kept in the loss."""
      weight = np.zeros(loss_mask.shape, np.float32)
      for rows in minibatch_rows:
        weight[rows] = token_weights(loss_mask[rows] & keep_N[rows, None], aggregation, max_len)
      return weight

    def plan(batch, weight, run_N, prox_NxT=None):
      """Per minibatch, the placed chunks of its rows in `run_N` (at least
      its shortest row, so that a minibatch without one still steps the
      optimiser, with a gradient of exactly zero)."""
      plans = []
      for rows in minibatch_rows:
        picked = rows[run_N[rows]]
        if not picked.size:
          picked = rows[np.argmin(lengths_N[rows])][None]
        chunks = [c._replace(rows=picked[c.rows]) for c in
                  length_chunks(lengths_N[picked], batch.tokens_NxT.shape[1], microbatch_tokens,
                                floor=min_width, row_multiple=row_multiple, max_rows=size)]
        parts = []
        for c in chunks:
          arrays, w = _chunk_arrays(batch, weight, c)
          p = None if prox_NxT is None else _take_rows(prox_NxT, c, c.width - 1)
          parts.append((*place((arrays, w, p)), float(arrays.loss_mask_NxT[:, 1:].sum()), c))
        plans.append(parts)
      return plans

    # A row whose advantage is exactly 0 (its group is degenerate, or it is
    # no group member) contributes exactly 0 to every objective, and a row
    # without a loss token to every term: without a KL term neither is run.
    # The token weights stay those of the whole minibatch, so the gradient
    # is the same sum over fewer rows.
    has_loss_N = loss_mask.any(axis=1)
    if skip_zero_advantage and ref_params is None:
      grad_N = has_loss_N & (np.asarray(batch.adv_N) != 0)
    else:
      grad_N = np.ones((N,), bool)
    weight = weights(np.ones((N,), bool))
    # Proximal log-probs under the incoming parameters, before any update.
    prox_NxT, mismatch, agreements = None, [], []
    keep_N = np.ones((N,), bool)
    if needs_prox:
      if off_policy in PROXIMAL:
        prox_NxT = np.zeros(loss_mask.shape, np.float32)
      for parts in plan(batch, weight, np.ones((N,), bool) if forward_all else grad_N):
        for arrays, _, _, _, c in parts:
          logp, stats, agreement, keep, _ = proximal(params, arrays)
          if prox_NxT is not None:
            prox_NxT[c.rows, :c.width - 1] = np.asarray(logp)[:len(c.rows)]
          mismatch.append(stats)
          agreements.append(agreement)
          keep_N[c.rows] = np.asarray(keep)[:len(c.rows)]
    rejected = int(np.sum(~keep_N & has_loss_N))
    if rejected:
      # Rejected rows leave the loss, and the aggregation's normalisers with
      # them (as `make_update` masks them); their proximal log-probs stand.
      full_mask = np.asarray(batch.loss_mask_NxT)
      batch = batch._replace(loss_mask_NxT=np.where(keep_N[:, None], full_mask, np.zeros_like(full_mask)))
      weight = weights(keep_N)
      if skip_zero_advantage and ref_params is None:
        grad_N = grad_N & keep_N
    all_stats, grad_rows = [], 0
    for parts in plan(batch, weight, grad_N, prox_NxT):
      grads, chunk_stats = None, []
      for arrays, w, p, count, c in parts:
        (_, stats), g = chunk_grad(params, arrays, w, p, ref_params)
        grads = g if grads is None else add_gradients(grads, g)
        chunk_stats.append((stats, count))
        grad_rows += len(c.rows)
      params, opt_state, grad_norm = apply(params, opt_state, grads)
      all_stats.append(dict(combine_loss_stats(chunk_stats), grad_norm=float(grad_norm)))
    stats = {k: float(np.mean([s[k] for s in all_stats])) for k in all_stats[0]}
    stats["gradient_rows"] = float(grad_rows)
    if measure_mismatch:
      stats.update(combine_mismatch_stats(mismatch, agreements))
    if mismatch_reject > 0:
      stats["mismatch_rejected_rows"] = float(rejected)
    return params, opt_state, stats

  return update
