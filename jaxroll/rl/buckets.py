"""Length buckets: rows of very uneven length laid out at a few static shapes.

Reasoning responses range from tens to thousands of tokens, so a batch
padded to its longest row spends most of its compute on padding. Rows are
grouped by the power-of-two width that holds them and split into chunks of
about `microbatch_tokens` tokens; each chunk's row count is padded to a
power of two, so a jitted function over chunks compiles a handful of times
(widths x row counts) instead of once per batch. Gradients over the chunks
of one batch add up to the batch's (the callers normalise by the batch).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np


def padded_width(length: int, cap: int, floor: int = 32) -> int:
  """The smallest power of two that holds `length` tokens, at least `floor`
  and at most `cap` (a row longer than `cap` is the caller's error)."""
  return min(cap, max(floor, 1 << max(0, length - 1).bit_length()))


class Chunk(NamedTuple):
  """Rows `rows` (indices into the batch) laid out at `width` tokens in an
  array of `num_rows` rows (the rows after len(rows) are empty padding)."""

  rows: np.ndarray
  width: int
  num_rows: int


def length_chunks(lengths: Sequence[int], cap: int, microbatch_tokens: int, *, floor: int = 32,
                  row_multiple: int = 1) -> list[Chunk]:
  """Chunks covering every row once, in increasing width.

  A row of `lengths[i]` tokens goes to width `padded_width(lengths[i], cap,
  floor)`; rows of one width share chunks of at most
  max(1, microbatch_tokens // width) rows (never more than the batch),
  and a chunk's array holds the next power of two of its rows, rounded up
  to a multiple of `row_multiple` (a mesh's data-parallel size). A batch
  whose rows all fit one chunk is laid out as it came: n rows, in order.
  """
  n = len(lengths)
  by_width: dict[int, list[int]] = {}
  for i, length in enumerate(lengths):
    if length > cap:
      raise ValueError(f"row {i} has {length} tokens > {cap}")
    by_width.setdefault(padded_width(int(length), cap, floor), []).append(i)
  out = []
  for width in sorted(by_width):
    rows = by_width[width]
    per = max(1, min(n, microbatch_tokens // width))
    for first in range(0, len(rows), per):
      part = rows[first:first + per]
      count = min(per, 1 << (len(part) - 1).bit_length())
      if len(part) == n:
        count = n
      count = -(-count // row_multiple) * row_multiple
      out.append(Chunk(np.asarray(part, np.int64), width, count))
  return out
