"""The warm start: supervised training on generated worked solutions.

RL from a random policy earns no reward, so the run first teaches the
policy the task's format and method from its worked solutions
with deliberate mistakes (`error_rate`) so that RL starts from a policy
that is right sometimes, not always: held-out accuracy well inside (0, 1).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxroll.data import IndexBatches
from jaxroll.rl.optim import adamw_warmup_cosine, add_gradients
from jaxroll.rl.policy_logp import next_token_logp
from jaxroll.rl.buckets import length_chunks
from jaxroll.tasks.base import Example


def sft_batch(examples: Sequence[Example], tokenizer, rng: np.random.Generator, error_rate: float,
              seq_len: int, solve: Callable, microbatch_tokens: int = 512
              ) -> list[tuple[np.ndarray, np.ndarray]]:
  """Tokens of prompt + worked solution + EOS and the mask of solution
  tokens, as micro-batches whose gradients add up to the batch's.

  Rows are laid out by `rl.buckets.length_chunks` (longest first, in
  chunks of `microbatch_tokens` slots at the power-of-two width of each
  chunk's longest row), so a batch costs about what its tokens cost, over
  one static shape per width.
  """
  rows = []
  for ex in examples:
    prompt = tokenizer.encode(ex.prompt)
    solution = tokenizer.encode(solve(ex.prompt, rng, error_rate),
                                add_special_tokens=False) + [tokenizer.eos_token_ids[0]]
    n = len(prompt) + len(solution)
    if n > seq_len:
      raise ValueError(f"example {ex.prompt!r} needs {n} tokens > seq_len={seq_len}")
    rows.append((prompt, solution))
  out = []
  for chunk in length_chunks([len(p) + len(s) for p, s in rows], seq_len, microbatch_tokens,
                             max_rows=len(examples)):
    tokens = np.zeros((chunk.num_rows, chunk.width), np.int32)
    mask = np.zeros((chunk.num_rows, chunk.width), bool)
    for i, r in enumerate(chunk.rows):
      prompt, solution = rows[r]
      tokens[i, :len(prompt) + len(solution)] = prompt + solution
      mask[i, len(prompt):len(prompt) + len(solution)] = True
    out.append((tokens, mask))
  return out


def _sft_loss(params, graphdef, tokens_NxT, mask_NxT, total):
  """The summed negative log-likelihood of the solution tokens over `total`,
  the batch's solution-token count (micro-batch losses add up to the batch's mean)."""
  logp = next_token_logp(graphdef, params, tokens_NxT)
  m = mask_NxT[:, 1:].astype(jnp.float32)
  return -(logp * m).sum() / total


def train(graphdef, params, examples: Sequence[Example], tokenizer, *, steps: int, batch_size: int,
          learning_rate: float, warmup_steps: int, error_rate: float, seq_len: int, seed: int,
          solve: Callable, microbatch_tokens: int = 512,
          log_fn: Callable[[int, float | None], None] | None = None, log_every: int = 50):
  """Runs `steps` supervised steps and returns the new params.

  Deterministic given `seed`: batches come from a seeded grain pipeline and
  the mistakes in step s from a generator seeded with (seed, s).
  `log_fn(s, loss)` is called after every step (for progress), with the
  loss every `log_every` steps and at the last, None otherwise (reading
  the loss waits for the device).
  """
  tx, _ = adamw_warmup_cosine(learning_rate=learning_rate, total_steps=steps,
                              warmup_steps=warmup_steps, end_lr_ratio=0.1)
  opt_state = tx.init(params)
  grad_fn = jax.value_and_grad(functools.partial(_sft_loss, graphdef=graphdef))

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, tokens, mask, total):
    loss, grads = grad_fn(params, tokens_NxT=tokens, mask_NxT=mask, total=total)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  # Several micro-batches: their gradients are summed, then one update.
  part_grad = jax.jit(lambda params, tokens, mask, total: grad_fn(
      params, tokens_NxT=tokens, mask_NxT=mask, total=total))

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def apply(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  batches = IndexBatches(len(examples), batch_size, seed)
  for s in range(steps):
    rng = np.random.default_rng([seed, s])
    parts = sft_batch([examples[i] for i in next(batches)], tokenizer, rng, error_rate, seq_len,
                      solve, microbatch_tokens)
    total = np.float32(max(1, sum(int(m[:, 1:].sum()) for _, m in parts)))
    if len(parts) == 1:
      params, opt_state, loss = step(params, opt_state, *parts[0], total)
    else:
      loss, grads = 0.0, None
      for tokens, mask in parts:
        part_loss, part = part_grad(params, tokens, mask, total)
        loss = loss + part_loss
        grads = part if grads is None else add_gradients(grads, part)
      params, opt_state = apply(params, opt_state, grads)
    if log_fn is not None:
      log_fn(s, float(loss) if s % log_every == 0 or s == steps - 1 else None)
  return params
