"""Loads a `tokenizer.json` saved beside a checkpoint through `tokenizers`."""

from __future__ import annotations

import json
import os
from typing import Optional

from jaxroll.errors import JaxrollError


class TokenizerError(JaxrollError, FileNotFoundError):
  """A checkpoint folder without a usable tokenizer."""


class Tokenizer:
  """A thin wrapper over `tokenizers.Tokenizer` with the ids RL needs.

  Example:
    tok = Tokenizer.from_folder("/path/to/Qwen2.5-0.5B")
    ids = tok.encode("1 + 1 =")
  """

  def __init__(self, backend, eos_token_ids: tuple[int, ...], pad_token_id: Optional[int]):
    self.backend = backend
    self.eos_token_ids = eos_token_ids
    self.pad_token_id = pad_token_id

  @classmethod
  def from_folder(cls, folder: str) -> "Tokenizer":
    import tokenizers  # imported here: only checkpoints with text need it

    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
      raise TokenizerError(f"{path}: missing; save the tokenizer beside the checkpoint")
    backend = tokenizers.Tokenizer.from_file(path)
    eos, pad = [], None
    for name in ("generation_config.json", "config.json"):
      p = os.path.join(folder, name)
      if os.path.isfile(p):
        with open(p) as f:
          cfg = json.load(f)
        ids = cfg.get("eos_token_id")
        if ids is not None and not eos:
          eos = [ids] if isinstance(ids, int) else list(ids)
        if pad is None:
          pad = cfg.get("pad_token_id")
    return cls(backend, tuple(eos), pad)

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size()

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
