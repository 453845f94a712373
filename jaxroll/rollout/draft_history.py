"""The prompts' earlier responses, kept across steps and epochs as draft sources.

RL revisits each prompt once per epoch, and a policy's answers to it change
slowly, so its earlier responses are the best drafts a speculative rollout
can get without a trained draft model (DAS, RhymeRL; SPEC-RL reuses the
last one). The engine records every finished row here and hands each new
row its prompt's history as a device source (jaxroll.rollout.drafters).

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


class DraftHistory:
  """The last `per_prompt` responses of each prompt, oldest first."""

  def __init__(self, per_prompt: int = 4):
    if per_prompt < 1:
      raise ValueError(f"per_prompt must be >= 1, got {per_prompt}")
    self.per_prompt = per_prompt
    self._responses = {}

  def __len__(self) -> int:
    return len(self._responses)

  def add(self, prompt, response) -> None:
    if len(response) == 0:
      return
    key = _prompt_key(prompt)
    queue = self._responses.setdefault(key, collections.deque(maxlen=self.per_prompt))
    queue.append(np.asarray(response, np.int32).copy())

  def source(self, prompt, length: int) -> np.ndarray:
    """[length] int32: the responses, each after a MARK, oldest first, cut
    from the front so the most recent text is kept; PAD after the end."""
    out = np.full((length,), drafters.PAD, np.int32)
    queue = self._responses.get(_prompt_key(prompt))
    if not queue:
      return out
    flat = np.concatenate([np.concatenate([[drafters.MARK], r]) for r in queue]).astype(np.int32)
    flat = flat[-length:]
    out[:flat.shape[0]] = flat
    return out

  def state_dict(self) -> dict:
    return {"per_prompt": self.per_prompt,
            "responses": {k: [r.tolist() for r in q] for k, q in self._responses.items()}}

  def load_state_dict(self, state: dict) -> None:
    self.per_prompt = int(state["per_prompt"])
    self._responses = {k: collections.deque((np.asarray(r, np.int32) for r in q), maxlen=self.per_prompt)
                       for k, q in state["responses"].items()}
