"""JetStream Engine API over jaxroll's rollout engine (optional extra).

`pip install -e .[jetstream]` brings `google-jetstream`; nothing else in
jaxroll imports this module. The adapter exposes the same prefill / insert /
generate functions the RL loop uses, so JetStream's orchestrator (or
MaxText-style serving code) drives the very engine jaxroll trains with:

  engine = RolloutEngine.for_model(model, num_slots=8, max_prompt_len=64, ...)
  js = JetStreamEngine(engine, model, tokenizer=IdTokenizer(bos_id=1, eos_id=2))
  driver = orchestrator.Driver(prefill_engines=[js], generate_engines=[js],
                               prefill_params=[js.load_params()],
                               generate_params=[js.load_params()])

JetStream 0.2.2 semantics: `prefill` returns only the prefix (the first token
comes from the first `generate`), `generate` advances every slot by one
token and reports (token, valid, length) per slot, and a request is complete
when JetStream sees a stop token, an invalid token or its max_tokens.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2

from jaxroll.rollout import decode
from jaxroll.rollout.engine import RolloutEngine

# JetStream 0.2.2 (its last release) frees prefixes with `jax.tree_map`, which
# jax removed in 0.6; without it the orchestrator's generate thread dies (and
# JetStream's thread wrapper then kills the whole process). Restore the alias.
if not hasattr(jax, "tree_map"):
  jax.tree_map = jax.tree_util.tree_map

_PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class IdTokenizer(tokenizer_api.Tokenizer):
  """A JetStream tokenizer for token-id requests (client-side tokenization).

  With a jaxroll `Tokenizer` it also encodes and decodes text.
  """

  def __init__(self, *, bos_id: int, eos_id: int, pad_id: int = 0, text_tokenizer=None):
    self._bos, self._eos, self._pad = bos_id, eos_id, pad_id
    self.text_tokenizer = text_tokenizer

  def encode(self, s: str, **kwargs):
    if self.text_tokenizer is None:
      raise ValueError("this engine has no text tokenizer; send token_content requests")
    from jetstream.engine import token_utils

    ids = np.asarray(self.text_tokenizer.encode(s, add_special_tokens=False), np.int32)
    return token_utils.pad_tokens(ids, self._bos, self._pad, is_bos=kwargs.get("is_bos", True),
                                  max_prefill_length=kwargs.get("max_prefill_length"),
                                  jax_padding=kwargs.get("jax_padding", True))

  def decode(self, token_ids: list[int], **kwargs) -> str:
    if self.text_tokenizer is None:
      return " ".join(str(int(t)) for t in token_ids)
    return self.text_tokenizer.decode(token_ids)

  @property
  def pad_id(self) -> int:
    return self._pad

  @property
  def eos_id(self) -> int:
    return self._eos

  @property
  def bos_id(self) -> int:
    return self._bos


@jax.jit
def _result_tokens_data(live_before_B, state: decode.DecodeState):
  """[B, 3] int32: the token generated this step, whether it is valid, count so far."""
  col_B = jnp.maximum(state.count_B - 1, 0)
  tok_B = jnp.take_along_axis(state.out_tokens_BxL, col_B[:, None], axis=1)[:, 0]
  return jnp.stack([tok_B, live_before_B.astype(jnp.int32), state.count_B], axis=1)


class JetStreamEngine(engine_api.Engine):
  """`jetstream.engine.engine_api.Engine` backed by a `RolloutEngine`.

  Args:
    engine: the rollout engine (its slots are JetStream's decode slots; its
      max_prompt_len must be one of JetStream's prefill buckets).
    model: the policy whose weights `load_params` returns.
    tokenizer: what `build_tokenizer` returns; its eos/pad ids are the stop
      tokens JetStream checks.
    seed: request i samples with `fold_in(key(seed), i)`, as row i of
      `RolloutEngine.rollout` does.
    version: policy version recorded for the loaded weights.
  """

  def __init__(self, engine: RolloutEngine, model, *, tokenizer: tokenizer_api.Tokenizer,
               seed: int = 0, version: int = 0):
    if engine.max_prompt_len not in _PREFILL_BUCKETS:
      raise ValueError(f"max_prompt_len={engine.max_prompt_len} must be one of JetStream's "
                       f"prefill buckets {_PREFILL_BUCKETS}")
    self.engine = engine
    self.model = model
    self.tokenizer = tokenizer
    self.version = version
    self._key = jax.random.key(seed)
    self._requests = itertools.count()
    self._lock = threading.Lock()
    self._mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",))

  def load_params(self, *args, **kwargs) -> decode.DecodeParams:
    return self.engine.load(self.model, version=self.version)

  def prefill(self, *, params: decode.DecodeParams, existing_prefix: Optional[Any] = None,
              padded_tokens: jax.Array, true_length: int) -> decode.Prefix:
    if existing_prefix is not None:
      raise NotImplementedError("prefill on top of an existing prefix: prefill the whole text instead")
    tokens = np.asarray(padded_tokens).reshape(-1)[:true_length].tolist()
    return self.engine.prefill(params, [tokens])

  def insert(self, prefix: decode.Prefix, decode_state: decode.DecodeState, slot: int) -> decode.DecodeState:
    with self._lock:  # request numbering is the key schedule
      n = next(self._requests)
    key = jax.random.fold_in(self._key, n)[None]
    return self.engine.insert(decode_state, prefix, [int(slot)], [0], key)

  def generate(self, params: decode.DecodeParams, decode_state: decode.DecodeState):
    live_before_B = decode_state.live_B
    state, _ = self.engine.generate(params, decode_state, max_steps=1)
    data = _result_tokens_data(live_before_B, state)
    return state, engine_api.ResultTokens(data=data, tokens_idx=(0, 1), valid_idx=(1, 2),
                                          length_idx=(2, 3), samples_per_slot=1)

  def get_prefix_destination_sharding(self) -> Any:
    return jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec())

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    return tokenizer_pb2.TokenizerParameters(path="jaxroll", extra_ids=0)

  def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> tokenizer_api.Tokenizer:
    return self.tokenizer

  def init_decode_state(self, *args, **kwargs) -> decode.DecodeState:
    return self.engine.init_decode_state()

  @property
  def max_concurrent_decodes(self) -> int:
    return self.engine.num_slots

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self.engine.max_prompt_len

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return self._mesh

  @property
  def colocated_cpus(self) -> None:
    return None
