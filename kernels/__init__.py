"""Attention and decoding kernels for jaxroll, installed as `jaxroll.kernels`.

Each kernel lives beside a pure-JAX reference of itself: the reference is the
oracle that tests compare accelerated versions against (in Pallas interpret
mode on CPU). `reference_attention` is also the default attention of the
model, and the seam through which paged or sparse decode kernels plug in.
`spec_verify` holds the exact verifier of speculative drafts (`verify`, the
Pallas kernel, and `verify_reference`). `paged_attention` is ragged attention
over a paged KV cache (Pallas kernel, an XLA path and a reference), and
`quest` scores and selects pages for sparse decoding.
"""

from jaxroll.kernels.attention import AttentionFn, reference_attention

__all__ = ["AttentionFn", "reference_attention"]
