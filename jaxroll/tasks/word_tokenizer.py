"""A word-level tokenizer for the built-in tasks (no files, no downloads)."""

from __future__ import annotations

from typing import Sequence

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


class WordTokenizer:
  """One token per whitespace-separated word of a fixed vocabulary.

  It has the interface of `jaxroll.model.tokenizer.Tokenizer` that the
  trainer uses (encode, decode, eos_token_ids, pad_token_id, vocab_size),
  so built-in tasks and Hugging Face checkpoints go through the same loop.

  Example:
    tok = WordTokenizer(["=1", "a+2", "?"])
    tok.decode(tok.encode("=1 a+2 ?"))  # "=1 a+2 ?"
  """

  def __init__(self, words: Sequence[str]):
    if len(set(words)) != len(words):
      raise ValueError("the vocabulary has repeated words")
    if any(not w or any(c.isspace() for c in w) for w in words):
      raise ValueError("vocabulary words must be non-empty and contain no whitespace")
    self.words = [PAD, BOS, EOS] + list(words)
    self._ids = {w: i for i, w in enumerate(self.words)}
    self.pad_token_id = 0
    self.bos_token_id = 1
    self.eos_token_ids = (2,)

  @property
  def vocab_size(self) -> int:
    return len(self.words)

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    try:
      ids = [self._ids[w] for w in text.split()]
    except KeyError as e:
      raise ValueError(f"word {e.args[0]!r} in {text!r} is not in the task's vocabulary") from None
    return [self.bos_token_id] + ids if add_special_tokens else ids

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    return " ".join(self.words[int(i)] for i in ids if not (skip_special_tokens and int(i) < 3))
