"""Held-out accuracy: the mean reward of `eval_samples` samples per held-out prompt.

Every evaluation samples with the same key, so differences between
evaluations come from the policy, not from the draw. With several
processes each samples its share of the prompts; the result covers all.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxroll import distributed


class HeldoutEvaluator:
  """Args:
    task: the prepared task (held-out examples and their token ids, tokenizer).
    engine: the RolloutEngine that samples (with the rollout thread, its own).
    rewards: the RewardRunner that scores (likewise).
    samples: samples per held-out prompt (cfg.eval_samples).
    key: the run's PRNG key.
  """

  def __init__(self, task, engine, rewards, samples: int, key):
    self.task, self.engine, self.rewards, self.G = task, engine, rewards, samples
    total = len(task.heldout) * samples
    rows = distributed.process_rows(total, "rows")
    eval_key = jax.random.fold_in(key, 2**31 - 1)
    # This process's rows of the keys rollout(key=eval_key) would give all rows.
    self.row_keys = jax.vmap(lambda n: jax.random.fold_in(eval_key, n))(jnp.arange(rows.start, rows.stop))

  def __call__(self, dparams) -> dict[str, Any]:
    G, task = self.G, self.task
    rows = distributed.process_rows(len(task.heldout), "task.num_heldout")
    examples = task.heldout[rows]
    traj = self.engine.rollout(dparams, task.heldout_tokens[rows], group_size=G, row_keys=self.row_keys)
    self.last_traj = traj  # this process's generations of the latest evaluation
    n_rows = range(len(traj.length_N))
    report = self.rewards.score([task.tokenizer.decode(traj.row(n)) for n in n_rows],
                                [examples[n // G].answer for n in n_rows])
    r_N = distributed.gather_rows(np.asarray(report.rewards))
    length_N = distributed.gather_rows(traj.length_N)
    difficulty_N = np.repeat([e.difficulty for e in task.heldout], G)
    by_difficulty = {str(d): float(r_N[difficulty_N == d].mean()) for d in np.unique(difficulty_N)}
    return {"heldout_accuracy": float(r_N.mean()), "heldout_tokens": int(length_N.sum()),
            "heldout_length_mean": float(length_N.mean()),
            "heldout_accuracy_by_difficulty": by_difficulty}
