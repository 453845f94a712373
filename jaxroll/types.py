"""Shape letters used in array names across jaxroll, defined once.

A name such as `logp_NxL` is an array of shape [N, L]. The letters:

  B  decode slots (rows of the decode batch)
  P  prompts
  G  samples per prompt (GRPO group size)
  N  trajectories, N = P * G
  T  tokens of a forward pass (prompt bucket, or 1 when decoding)
  L  generated tokens per trajectory (the max_new_tokens bucket)
  S  KV-cache length per slot
  E  model width (hidden size)
  F  MLP width
  H  query heads;  K  key/value heads;  R = H // K query heads per KV head
  D  head dimension
  V  vocabulary
"""

# Finish reasons recorded per trajectory (int32 codes, stable across versions).
FINISH_RUNNING = 0
FINISH_STOP = 1  # a stop token was sampled (it is part of the output)
FINISH_LENGTH = 2  # max_new_tokens reached

FINISH_NAMES = {FINISH_RUNNING: "running", FINISH_STOP: "stop", FINISH_LENGTH: "length"}
