"""Token sampling with temperature, top-k and top-p, and its exact log-probability.

RL needs the behaviour log-probability of each sampled token under the very
distribution it was drawn from (after temperature and truncation), so
off-policy and mismatch corrections later divide by the right number. The
sampler therefore returns `(token, logp)` from one computation.

Draws use inverse-CDF sampling with one uniform per row instead of Gumbel
noise over the vocabulary: the distribution is the same, and it costs one
random number per row rather than V (151,936 for Qwen2), which matters on
the decode path.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxroll.kernels.spec_verify import mix32


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How the next token is drawn; hashable, so it is a compile-time constant.

  Attributes:
    temperature: logits are divided by it; 0 means greedy (argmax), whose
      recorded log-probability is 0 (a point mass).
    top_k: keep the k most likely tokens; 0 keeps all.
    top_p: keep the smallest set of most likely tokens whose probability
      reaches top_p (a token is kept when the mass strictly above it is
      below top_p); 1.0 keeps all.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


# Tokens per block of the two-level inverse CDF (see _inverse_cdf).
CDF_BLOCK = 512
# Width of the triangular matrices `prefix_sums` multiplies by.
SCAN_BLOCK = 32


def _ones_upper(n: int, strict: bool = False):
  """[n, n] float32 with ones where column >= row (> with `strict`)."""
  return jnp.triu(jnp.ones((n, n), jnp.float32), 1 if strict else 0)


def prefix_sums(x_BxK):
  """Inclusive cumulative sums along the last axis, as matmuls.

  Blocks of SCAN_BLOCK entries are summed by one matmul with a triangular
  ones matrix, and the blocks' totals are offset by the cumulative sums of
  the totals before them (the same construction, one level up). XLA's own
  cumulative sum on CPU is a tree of reduce-windows: with it the sampling
  rule took twice as long at V=1024 (69 against 33 us for 16 rows). Full
  float32 precision on every backend (TPUs and GPUs would otherwise
  multiply float32 in lower precision).
  """
  dot = lambda a, b: jnp.dot(a, b, precision=lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
  B, K = x_BxK.shape
  x_BxK = x_BxK.astype(jnp.float32)
  if K <= SCAN_BLOCK:
    return dot(x_BxK, _ones_upper(K))
  n = -(-K // SCAN_BLOCK)
  x_BxNxT = jnp.pad(x_BxK, ((0, 0), (0, n * SCAN_BLOCK - K))).reshape(B, n, SCAN_BLOCK)
  within_BxNxT = dot(x_BxNxT, _ones_upper(SCAN_BLOCK))
  totals_BxN = within_BxNxT[:, :, -1]
  before_BxN = (dot(totals_BxN, _ones_upper(n, strict=True)) if n <= SCAN_BLOCK else
                jnp.pad(prefix_sums(totals_BxN)[:, :-1], ((0, 0), (1, 0))))
  return (within_BxNxT + before_BxN[:, :, None]).reshape(B, n * SCAN_BLOCK)[:, :K]


def _first_reaching(cdf_BxK, target_B):
  """Index i with cdf[i-1] <= target < cdf[i], clamped to the last index
  that still adds mass (rounding can push the target onto the total): the
  first index where the cdf reaches its total. Counts, not an argmax: XLA's
  CPU argmax is a slow variadic reduction."""
  idx_B = jnp.sum(cdf_BxK <= target_B[:, None], axis=-1)
  last_B = jnp.sum(cdf_BxK < cdf_BxK[:, -1:], axis=-1)
  return jnp.minimum(idx_B, last_B)


def _inverse_cdf(p_BxK, u_B):
  """Index i with cdf[i-1] <= u * total < cdf[i] of the (unnormalised)
  masses `p`, never a zero-mass index; and the total.

  Over a large vocabulary the cdf is taken in two levels: per-block sums
  and their cumulative sum pick the block the target falls in, and only
  that block's cumulative sum is formed. A cumulative sum over all of V
  (151,936 for Qwen2) costs XLA:CPU about as much as streaming the head's
  weights; block sums cost one pass. The law of the draw is the same; the
  float rounding at block edges differs from one flat sum's.
  """
  B, K = p_BxK.shape
  if K <= 4 * CDF_BLOCK:
    cdf_BxK = prefix_sums(p_BxK)
    total_B = cdf_BxK[:, -1]
    return _first_reaching(cdf_BxK, u_B * total_B).astype(jnp.int32), total_B
  n = -(-K // CDF_BLOCK)
  p_BxNxT = jnp.pad(p_BxK, ((0, 0), (0, n * CDF_BLOCK - K))).reshape(B, n, CDF_BLOCK)
  block_cdf_BxN = prefix_sums(p_BxNxT.sum(axis=-1))
  total_B = block_cdf_BxN[:, -1]
  target_B = u_B * total_B
  j_B = _first_reaching(block_cdf_BxN, target_B)  # a block with mass
  before_B = jnp.where(j_B > 0, jnp.take_along_axis(block_cdf_BxN, jnp.maximum(j_B - 1, 0)[:, None],
                                                    axis=-1)[:, 0], 0.0)
  inner_BxT = jnp.take_along_axis(p_BxNxT, j_B[:, None, None], axis=1)[:, 0]
  within_B = _first_reaching(before_B[:, None] + prefix_sums(inner_BxT), target_B)
  return (j_B * CDF_BLOCK + within_B).astype(jnp.int32), total_B


def filtered_logits(logits_BxV, params: SamplingParams):
  """The (value, token id) pairs left after temperature/top-k/top-p.

  Returns:
    (scores_BxK, ids_BxK or None): scores are logits / temperature with the
    removed tokens at -inf; ids is None when nothing was truncated (K = V and
    scores are indexed by token id).
  """
  scaled = logits_BxV.astype(jnp.float32) / params.temperature
  V = scaled.shape[-1]
  if params.top_k == 0 and params.top_p >= 1.0:
    return scaled, None
  k = min(params.top_k, V) if params.top_k else V
  vals_BxK, ids_BxK = lax.top_k(scaled, k)  # sorted, most likely first
  if params.top_p < 1.0:
    p_BxK = jax.nn.softmax(vals_BxK, axis=-1)
    mass_above_BxK = jnp.cumsum(p_BxK, axis=-1) - p_BxK
    vals_BxK = jnp.where(mass_above_BxK < params.top_p, vals_BxK, -jnp.inf)
  return vals_BxK, ids_BxK


def sample_tokens(logits_BxV, u_B, params: SamplingParams):
  """Draws one token per row and returns its log-probability.

  Args:
    logits_BxV: next-token logits.
    u_B: one uniform number in [0, 1) per row (the row's randomness).
    params: the sampling rule.

  Returns:
    (tokens_B int32, logp_B float32): logp is the log-probability of the
    token under the filtered, temperature-scaled distribution it was drawn
    from.
  """
  if params.greedy:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32), jnp.zeros(logits_BxV.shape[:1], jnp.float32)
  scores_BxK, ids_BxK = filtered_logits(logits_BxV, params)
  # Masses relative to the largest (no normalised copy of the distribution:
  # the cdf's total is the normaliser).
  shifted_BxK = scores_BxK - jnp.max(scores_BxK, axis=-1, keepdims=True)
  choice_B, total_B = _inverse_cdf(jnp.exp(shifted_BxK), u_B)
  logp_B = jnp.take_along_axis(shifted_BxK, choice_B[:, None], axis=-1)[:, 0] - jnp.log(total_B)
  if ids_BxK is None:
    return choice_B, logp_B
  return jnp.take_along_axis(ids_BxK, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32), logp_B


def token_logp(logits_BxV, tokens_B, params: SamplingParams):
  """log-probability of given tokens under the filtered, temperature-scaled
  distribution of `logits_BxV` (-inf for a token the filter removed)."""
  scores_BxK, ids_BxK = filtered_logits(logits_BxV, params)
  logp_BxK = jax.nn.log_softmax(scores_BxK, axis=-1)
  if ids_BxK is None:
    return jnp.take_along_axis(logp_BxK, tokens_B[:, None], axis=-1)[:, 0]
  match_BxK = ids_BxK == tokens_B[:, None]
  return jnp.where(match_BxK.any(-1), jnp.sum(jnp.where(match_BxK, logp_BxK, 0.0), axis=-1), -jnp.inf)


# Compiler options for the programs that only hash seeds (threefry, unrolled
# into a long chain of integer ops): XLA's backend optimisations cannot
# change an integer result and took about half of their compile time.
SEED_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0}


def row_seeds(keys_B):
  """Two 32-bit words of seed per row, drawn once from the row's PRNG key."""
  return jax.vmap(lambda k: jax.random.bits(k, (2,), jnp.uint32))(keys_B)


def folded_row_seeds(key, rows_N):
  """`row_seeds` of the keys fold_in(key, n) for the row numbers n in `rows_N`."""
  return row_seeds(jax.vmap(lambda n: jax.random.fold_in(key, n))(rows_N))


def row_uniforms(seeds_Bx2, counters_B):
  """One uniform in [0, 1) per row from the row's seed and token counter.

  Depending only on the row's own seed and on how many tokens it has
  produced, a row's draws do not depend on its slot, its batch mates or when
  it was inserted: continuous batching reproduces one-by-one decoding
  exactly. A counter-based hash rather than `jax.random` inside the decode
  loop: threefry compiles to a loop of small kernels that cost more per step
  than the whole sampling rule for small models. 24 random bits per draw, the
  resolution of a float32 uniform.
  """
  c = counters_B.astype(jnp.uint32) * jnp.uint32(0x9E3779B9) + seeds_Bx2[:, 0]
  h = mix32(mix32(c) ^ seeds_Bx2[:, 1])
  return (h >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)
