"""NumPy statement of the sampling rule, independent of jaxroll's JAX code."""

import numpy as np


def filtered_distribution(logits_V, temperature, top_k=0, top_p=1.0):
  """Probabilities over V after temperature, top-k, then top-p (float64)."""
  x = np.asarray(logits_V, np.float64) / temperature
  keep = np.ones_like(x, bool)
  order = np.argsort(-x, kind="stable")
  if top_k:
    keep[order[top_k:]] = False
  p = np.exp(x - x.max()) * keep
  p /= p.sum()
  if top_p < 1.0:
    sorted_p = p[order]
    mass_above = np.cumsum(sorted_p) - sorted_p
    drop = order[(mass_above >= top_p) & keep[order]]
    keep[drop] = False
    p = p * keep
    p /= p.sum()
  return p


def chi_square_pvalue(counts, probs):
  """Pearson chi-square p-value, bins with expected count < 5 pooled."""
  from scipy import stats

  counts, probs = np.asarray(counts, float), np.asarray(probs, float)
  n = counts.sum()
  assert counts[probs == 0].sum() == 0, "sampled a token with zero probability"
  big = probs * n >= 5
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(probs[big] * n, probs[~big].sum() * n)
  if exp[-1] == 0:
    obs, exp = obs[:-1], exp[:-1]
  return stats.chisquare(obs, exp).pvalue
