"""Length buckets: rows of very uneven length laid out at a few static shapes.

Reasoning responses range from tens to thousands of tokens, so a batch
padded to its longest row spends most of its compute on padding. Rows are
taken longest first into chunks of `microbatch_tokens` token slots: a
chunk's width is the power of two that holds its first (longest) row, and
it holds as many rows as fit that many slots at that width, the rows after
its first being no longer. Every chunk of one width therefore has one
shape, so a jitted function over chunks compiles once per width (a handful
in a run), never again for a new row count: on CPU a compilation costs
about as much as the update of a whole batch. Gradients over the chunks of
one batch add up to the batch's (the callers normalise by the batch).
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


def rows_per_chunk(width: int, microbatch_tokens: int, max_rows: int, row_multiple: int = 1) -> int:
  """Rows of every chunk of `width`: as many as `microbatch_tokens` slots
  hold (at least one), at most `max_rows` (the batch's rows, so a small
  batch is not padded past itself), rounded up to a multiple of
  `row_multiple` (a mesh's data-parallel size)."""
  rows = max(1, min(max_rows, microbatch_tokens // width))
  return -(-rows // row_multiple) * row_multiple


def length_chunks(lengths: Sequence[int], cap: int, microbatch_tokens: int, *, floor: int = 32,
                  row_multiple: int = 1, max_rows: int | None = None) -> list[Chunk]:
  """Chunks covering every row once, longest rows first.

  A chunk starts at the longest row not yet placed, at that row's
  `padded_width(length, cap, floor)`, and takes the next rows in
  decreasing length (ties in index order) up to `rows_per_chunk(width,
  microbatch_tokens, max_rows, row_multiple)`; the slots after the last
  row are empty padding. `max_rows` is the most rows a batch can have
  (default: this batch's): passing a fixed one keeps the shapes fixed
  while the number of rows varies.
  """
  lengths = np.asarray(lengths, np.int64).reshape(-1)
  for i, length in enumerate(lengths):
    if length > cap:
      raise ValueError(f"row {i} has {length} tokens > {cap}")
  max_rows = len(lengths) if max_rows is None else max_rows
  if len(lengths) > max_rows:
    raise ValueError(f"{len(lengths)} rows > max_rows={max_rows}")
  order = np.argsort(-lengths, kind="stable")
  out, first = [], 0
  while first < len(order):
    width = padded_width(int(lengths[order[first]]), cap, floor)
    count = rows_per_chunk(width, microbatch_tokens, max_rows, row_multiple)
    out.append(Chunk(order[first:first + count], width, count))
    first += count
  return out
