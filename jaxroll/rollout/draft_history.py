"""The prompts' earlier responses, kept across steps and epochs as draft sources.

RL revisits each prompt once per epoch, and a policy's answers to it change
slowly, so its earlier responses are the best drafts a speculative rollout
can get without a trained draft model (DAS, RhymeRL; SPEC-RL reuses the
last one). The engine records every finished row here and hands each new
row its prompt's history as a device source (jaxroll.rollout.drafters).

A prompt seen for the first time has no history of its own; with a global
window (SuffixDecoding's fallback) it drafts from the most recent responses
to other prompts, which in a task of one format share much of their text.

The history only changes speed, never what is sampled, but a resumed run
should decode as fast as the one it continues, so it round-trips through
`state_dict` into the checkpoint.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from jaxroll.rollout import drafters


def _prompt_key(prompt) -> str:
  return hashlib.sha1(np.asarray(prompt, np.int32).tobytes()).hexdigest()


def _framed(responses, length: int) -> np.ndarray:
  """[length] int32: each response after a MARK, oldest first, cut from the
  front so the most recent text is kept; PAD after the end."""
  out = np.full((length,), drafters.PAD, np.int32)
  if not responses:
    return out
  flat = np.concatenate([np.concatenate([[drafters.MARK], r]) for r in responses]).astype(np.int32)
  flat = flat[-length:]
  out[:flat.shape[0]] = flat
  return out


class DraftHistory:
  """The last `per_prompt` responses of each prompt, oldest first, and the
  last `recent` responses to any prompt (the global fallback)."""

  def __init__(self, per_prompt: int = 4, recent: int = 64):
    if per_prompt < 1 or recent < 1:
      raise ValueError(f"per_prompt and recent must be >= 1, got {per_prompt} and {recent}")
    self.per_prompt = per_prompt
    self._responses = {}
    self._recent = collections.deque(maxlen=recent)  # (prompt key, response)

  def __len__(self) -> int:
    return len(self._responses)

  def add(self, prompt, response) -> None:
    if len(response) == 0:
      return
    key = _prompt_key(prompt)
    queue = self._responses.setdefault(key, collections.deque(maxlen=self.per_prompt))
    response = np.asarray(response, np.int32).copy()
    queue.append(response)
    self._recent.append((key, response))

  def source(self, prompt, length: int) -> np.ndarray:
    """[length] int32: the responses, each after a MARK, oldest first, cut
    from the front so the most recent text is kept; PAD after the end."""
    return _framed(self._responses.get(_prompt_key(prompt)), length)

  def global_source(self, prompt, length: int) -> np.ndarray:
    """[length] int32: the most recent responses to other prompts, framed
    as `source` frames them (the prompt's own are in its `source`)."""
    key = _prompt_key(prompt)
    return _framed([r for k, r in self._recent if k != key], length)

  def state_dict(self) -> dict:
    return {"per_prompt": self.per_prompt,
            "responses": {k: [r.tolist() for r in q] for k, q in self._responses.items()},
            "recent_size": self._recent.maxlen,
            "recent": [[k, r.tolist()] for k, r in self._recent]}

  def load_state_dict(self, state: dict) -> None:
    self.per_prompt = int(state["per_prompt"])
    self._responses = {k: collections.deque((np.asarray(r, np.int32) for r in q), maxlen=self.per_prompt)
                       for k, q in state["responses"].items()}
    # Checkpoints written before the global window have none: it refills.
    self._recent = collections.deque(((k, np.asarray(r, np.int32)) for k, r in state.get("recent", [])),
                                     maxlen=int(state.get("recent_size", self._recent.maxlen)))
