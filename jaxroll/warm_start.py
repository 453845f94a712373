"""The warm start: supervised training on generated worked solutions.

RL from a random policy earns no reward, so the run first teaches the
policy the task's format and method from `mod_walk.worked_solution`,
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
from jaxroll.rl.optim import adamw_warmup_cosine
from jaxroll.rl.policy_logp import next_token_logp
from jaxroll.tasks import mod_walk
from jaxroll.tasks.base import Example


def sft_batch(examples: Sequence[Example], tokenizer, rng: np.random.Generator, error_rate: float,
              seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Tokens of prompt + worked solution + EOS, and the mask of solution tokens."""
  tokens = np.zeros((len(examples), seq_len), np.int32)
  mask = np.zeros((len(examples), seq_len), bool)
  for i, ex in enumerate(examples):
    prompt = tokenizer.encode(ex.prompt)
    solution = tokenizer.encode(
        mod_walk.worked_solution(mod_walk.parse_problem(ex.prompt), rng, error_rate),
        add_special_tokens=False) + [tokenizer.eos_token_ids[0]]
    row = prompt + solution
    if len(row) > seq_len:
      raise ValueError(f"example {ex.prompt!r} needs {len(row)} tokens > seq_len={seq_len}")
    tokens[i, :len(row)] = row
    mask[i, len(prompt):len(row)] = True
  return tokens, mask


def _sft_loss(params, graphdef, tokens_NxT, mask_NxT):
  logp = next_token_logp(graphdef, params, tokens_NxT)
  m = mask_NxT[:, 1:].astype(jnp.float32)
  return -(logp * m).sum() / jnp.maximum(m.sum(), 1.0)


def train(graphdef, params, examples: Sequence[Example], tokenizer, *, steps: int, batch_size: int,
          learning_rate: float, warmup_steps: int, error_rate: float, seq_len: int, seed: int,
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
  def step(params, opt_state, tokens, mask):
    loss, grads = grad_fn(params, tokens_NxT=tokens, mask_NxT=mask)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  batches = IndexBatches(len(examples), batch_size, seed)
  for s in range(steps):
    rng = np.random.default_rng([seed, s])
    tokens, mask = sft_batch([examples[i] for i in next(batches)], tokenizer, rng, error_rate, seq_len)
    params, opt_state, loss = step(params, opt_state, tokens, mask)
    if log_fn is not None:
      log_fn(s, float(loss) if s % log_every == 0 or s == steps - 1 else None)
  return params
