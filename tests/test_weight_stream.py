"""The weight-stream probe times what a decode step would read, in a loop
as the engine's steps run."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxroll.model import transformer
from jaxroll.rollout import weight_stream

SHAPES = [(32, 96), (32, 32), (32, 128), (64, 32), (32, 100)]


def _while_body(hlo: str) -> str:
  """The text of the compiled program's while-loop body computation."""
  body = re.search(r"body=%?([\w.\-]+)", hlo).group(1)
  (text,) = [c for c in re.split(r"\n(?=\S)", hlo) if c.lstrip("%").startswith(body + " ")]
  return text


def test_float_chains_apply_the_chain_once_per_loop_iteration():
  rng = np.random.default_rng(0)
  ws = [jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.1) for s in SHAPES]
  x = jnp.asarray(rng.standard_normal((4, 32), dtype=np.float32))
  h = x
  for _ in range(weight_stream.CHAINS_PER_CALL):
    h = weight_stream._fit(weight_stream._chain(ws, h, jnp, transformer.matmul), 32, jnp)
  np.testing.assert_allclose(np.asarray(jax.jit(weight_stream.float_chains)(ws, x)), np.asarray(h),
                             rtol=1e-4, atol=1e-5)


def test_the_int8_chain_reads_int8_weights_in_every_iteration():
  # XLA hoists loop-invariant work out of a while loop: a conversion of the
  # int8 weights left invariant would run once, and the loop would stream
  # float32 weights instead.
  qs = [jnp.ones(s, jnp.int8) for s in SHAPES]
  scales = [jnp.ones((s[1],), jnp.float32) for s in SHAPES]
  x = jnp.ones((4, 32), jnp.float32)
  hlo = jax.jit(weight_stream.int8_chains).lower(qs, scales, x).compile().as_text()
  body = _while_body(hlo)
  for s in SHAPES:
    assert f"s8[{s[0]},{s[1]}]" in body
