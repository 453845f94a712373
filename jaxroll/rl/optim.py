"""The optimiser: AdamW with linear warm-up, cosine decay and global-norm clipping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

# The sum of two gradient trees (micro-batches or length chunks of one batch)
# as one program; the first one's buffers are reused for the result.
add_gradients = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=0)


def adamw_warmup_cosine(*, learning_rate: float, total_steps: int, warmup_steps: int = 0,
                        end_lr_ratio: float = 0.0, weight_decay: float = 0.0,
                        max_grad_norm: float = 1.0, b1: float = 0.9, b2: float = 0.999):
  """Returns (optax transformation, learning-rate schedule).

  The schedule rises linearly from 0 over `warmup_steps`, then follows a
  cosine to `learning_rate * end_lr_ratio` at `total_steps` (counted in
  optimiser updates). Gradients are clipped to `max_grad_norm` first.
  """
  warmup = min(warmup_steps, max(total_steps - 1, 0))
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0 if warmup else learning_rate, peak_value=learning_rate,
      warmup_steps=warmup, decay_steps=max(total_steps, warmup + 1),
      end_value=learning_rate * end_lr_ratio)
  tx = optax.chain(optax.clip_by_global_norm(max_grad_norm),
                   optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay))
  return tx, schedule
