"""R2PO (Wang et al., 2026): a residual rollout head decouples training rollouts from inference.

Training rollouts sample from logits + head(h) (jaxroll.model.residual_head);
evaluation and every inference path sample from the policy alone, bit for
bit (the head never enters their weights). Two signals, as in the
authors' code (github.com/RRPO-ARR/Code, simple_grpo_v1):

- the policy is updated on the head's rollouts as if they were its own:
  the engine records, for each drawn token, the policy's log-prob without
  the head, so the ratio starts at 1 and no importance weight corrects
  for the head (rl.off_policy works as usual on top of that);
- the head is updated with the policy frozen by a policy gradient on
  *rarity* advantages: within a group a rollout scores 1 / (how many of
  the group share its reward), standardised over the group, so the head
  learns to steer rollouts towards the outcomes the group rarely reaches.

The authors alternate phases of head training and policy training over
separate rollouts; here both updates use each step's batch, the head's
first, on the weights that sampled it. The head's parameters and
optimiser state are saved with every checkpoint.

Correctness (survey Section 6.3): empirical only. The policy's gradient
is taken on another distribution's samples without correction, by design.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxroll.behaviour import PolicyBehaviour
from jaxroll.model.residual_head import init_residual_head
from jaxroll.rl.losses import aggregate
from jaxroll.rl.policy_logp import next_token_logp
from jaxroll.rollout.sampling import SamplingParams


def rarity_advantages(reward_N, group_size: int, valid_N=None, eps: float = 1e-6) -> np.ndarray:
  """Per row: 1 / (count of its group's valid rows with the same reward),
  standardised within the group (ddof=1); 0 for a group whose scores are
  all equal, for invalid rows, and for groups with fewer than 2 valid rows."""
  r_PxG = np.asarray(reward_N, np.float64).reshape(-1, group_size)
  v_PxG = (np.ones_like(r_PxG, bool) if valid_N is None
           else np.asarray(valid_N, bool).reshape(-1, group_size))
  out = np.zeros_like(r_PxG)
  for p in range(r_PxG.shape[0]):
    r = r_PxG[p, v_PxG[p]]
    if r.size < 2:
      continue
    _, inverse, counts = np.unique(r, return_inverse=True, return_counts=True)
    score = 1.0 / counts[inverse]
    if np.all(score == score[0]):
      continue
    out[p, v_PxG[p]] = (score - score.mean()) / (score.std(ddof=1) + eps)
  return out.reshape(-1).astype(np.float32)


def head_loss(head, params, graphdef, tokens_NxT, mask_NxT, behaviour_NxT, adv_N, *, sampling,
              aggregation: str, max_len: int):
  """On-policy policy gradient for the head (the policy held fixed), and
  the estimate of KL(rollout || policy) from the rollout's own tokens
  (`behaviour_NxT` holds the policy's log-probs, as the sampler records them)."""
  logp_NxT = next_token_logp(graphdef, jax.lax.stop_gradient(params), tokens_NxT, sampling,
                             residual=head)
  logp_NxT = jnp.where(mask_NxT, logp_NxT, 0.0)
  objective = adv_N[:, None] * jnp.exp(logp_NxT - jax.lax.stop_gradient(logp_NxT))
  loss = -aggregate(objective, mask_NxT, aggregation, max_len)
  m = mask_NxT.astype(jnp.float32)
  return loss, rollout_policy_kl(logp_NxT, behaviour_NxT, m)


def rollout_policy_kl(rollout_logp_NxT, policy_logp_NxT, mask_NxT):
  """KL(rollout || policy) per loss token from tokens the rollout drew.

  Schulman's k3 estimator, (r - 1) - log r with r = policy / rollout:
  unbiased like the plain mean of log(rollout / policy), and never
  negative for any one token, so a batch's estimate cannot come out below
  zero. log r is kept >= -30 so that a token the policy cannot draw (top-k
  or top-p) counts as a large divergence, not an infinite one.
  """
  log_r = jnp.maximum(jax.lax.stop_gradient(policy_logp_NxT - rollout_logp_NxT), -30.0)
  k3 = jnp.expm1(log_r) - log_r
  return jnp.sum(jnp.where(mask_NxT > 0, k3, 0.0)) / jnp.maximum(mask_NxT.sum(), 1.0)


class R2POBehaviour(PolicyBehaviour):
  kind = "r2po"

  def __init__(self, cfg, model_cfg, graphdef, placement=None):
    super().__init__(model_cfg, graphdef)
    b, r = cfg.behaviour, cfg.rollout
    key = jax.random.fold_in(jax.random.key(cfg.seed), 0x52325)
    self.head = init_residual_head(key, model_cfg.hidden_size, model_cfg.vocab_size, b.head_init_std)
    if placement is not None and placement.mesh is not None:
      # Replicated over the training mesh, where the policy's weights live.
      from jax.sharding import NamedSharding, PartitionSpec

      self.head = jax.device_put(self.head, NamedSharding(placement.mesh, PartitionSpec()))
    self.tx = optax.chain(optax.clip_by_global_norm(cfg.rl.max_grad_norm), optax.adam(b.head_learning_rate))
    self.opt_state = self.tx.init(self.head)
    grad_fn = jax.value_and_grad(functools.partial(
        head_loss, graphdef=graphdef, sampling=SamplingParams(r.temperature, r.top_k, r.top_p),
        aggregation=cfg.rl.aggregation, max_len=r.max_prompt_len + r.max_new_tokens - 1), has_aux=True)

    @jax.jit
    def update(head, opt_state, params, tokens, mask, behaviour, adv):
      (loss, kl), grads = grad_fn(head, params, tokens_NxT=tokens, mask_NxT=mask,
                                  behaviour_NxT=behaviour, adv_N=adv)
      updates, opt_state = self.tx.update(grads, opt_state, head)
      return optax.apply_updates(head, updates), opt_state, {
          "r2po_head_loss": loss, "r2po_head_kl": kl, "r2po_head_grad_norm": optax.tree.norm(grads)}

    self._update = update

  def decode_args(self, params, version: int):
    return params, {"residual": self.head}

  def learn(self, params, ub, sample) -> dict[str, float]:
    """One head update on the step's rows (ub: jaxroll.loop.update_batch.UpdateBatch)."""
    members_N = sample.sampled_N & (sample.weight_N > 0)
    adv_N = rarity_advantages(sample.reward_N, sample.group_size, members_N)[ub.rows]
    b = ub.packed
    self.head, self.opt_state, stats = self._update(
        self.head, self.opt_state, params, b.tokens_NxT, b.loss_mask_NxT[:, 1:],
        b.behaviour_logp_NxT[:, 1:], adv_N)
    return {**{k: float(v) for k, v in stats.items()},
            "r2po_rarity_adv_abs_mean": float(np.abs(adv_N).mean()) if adv_N.size else 0.0}

  def state(self):
    return {"head": self.head, "opt_state": self.opt_state}

  def load_state(self, state) -> None:
    self.head, self.opt_state = state["head"], state["opt_state"]
