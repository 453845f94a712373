"""Shape letters used in array names across jaxroll, defined once.

A name such as `logp_NxL` is an array of shape [N, L]. The letters:

  B  decode slots (rows of the decode batch)
  P  prompts
  G  samples per prompt (GRPO group size)
  N  trajectories, N = P * G
  Q  prompts in the training pool (per-prompt statistics of the replay state)
  K  candidate prompts a rollout plan considers
  C  groups held in the replay buffer
  T  tokens of a forward pass (prompt bucket, or 1 when decoding)
  L  generated tokens per trajectory (the max_new_tokens bucket)
  S  KV-cache length per slot
  E  model width (hidden size)
  F  MLP width
  H  query heads;  K  key/value heads;  R = H // K query heads per KV head
  D  head dimension
  V  vocabulary
"""

import dataclasses

import numpy as np

# Finish reasons recorded per trajectory (int32 codes, stable across versions).
FINISH_RUNNING = 0
FINISH_STOP = 1  # a stop token was sampled (it is part of the output)
FINISH_LENGTH = 2  # max_new_tokens reached
# A row of a group that its plan did not ask for (PODS draws fewer than the
# update's rows per group; VIGOR adds rows later): the engine leaves it
# alone, as it does a finished row, and it holds no tokens.
FINISH_UNSAMPLED = 3
# Engine-internal: the row found no free KV page (jaxroll.model.paged_kv_cache)
# and gave its pages back; the engine resumes it, so no Trajectories row
# ever carries this code.
FINISH_PREEMPTED = 4

FINISH_NAMES = {FINISH_RUNNING: "running", FINISH_STOP: "stop", FINISH_LENGTH: "length",
                FINISH_UNSAMPLED: "unsampled"}
SAMPLED = (FINISH_STOP, FINISH_LENGTH)  # the codes of a row that was sampled to its end


@dataclasses.dataclass
class Trajectories:
  """N sampled completions on the host, in request order (row n = prompt n // G).

  Every generated token carries what off-policy correction and partial
  rollout need: its behaviour log-probability, absolute position and the
  policy version that sampled it. Entries past `length_N` are padding.
  """

  prompt_index_N: np.ndarray  # int32
  sample_index_N: np.ndarray  # int32, index within the prompt's group
  tokens_NxL: np.ndarray  # int32
  logp_NxL: np.ndarray  # float32 behaviour log-probs
  position_NxL: np.ndarray  # int32
  version_NxL: np.ndarray  # int32
  length_N: np.ndarray  # int32 generated tokens (a sampled stop token included)
  finish_N: np.ndarray  # int32 FINISH_* code

  @property
  def mask_NxL(self) -> np.ndarray:
    return np.arange(self.tokens_NxL.shape[1])[None, :] < self.length_N[:, None]

  @property
  def num_tokens(self) -> int:
    return int(self.length_N.sum())

  def row(self, n: int) -> list[int]:
    return self.tokens_NxL[n, :self.length_N[n]].tolist()

  def take(self, rows) -> "Trajectories":
    """Rows `rows`, in that order (each keeps its prompt index)."""
    return Trajectories(*(getattr(self, f.name)[rows] for f in dataclasses.fields(self)))
