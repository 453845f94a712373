"""RolloutEngine: batched sampling of G completions per prompt, for RL.

Host side of the rollout: validates requests, pads them into shape buckets,
prefills each prompt once, feeds rows into free decode slots as others
finish (continuous batching), and gathers the finished rows into
`Trajectories`. The device side is `jaxroll.rollout.decode`.

Example:
  engine = RolloutEngine.for_model(model, num_slots=16, max_prompt_len=64,
                                   max_new_tokens=128, stop_token_ids=[eos])
  params = engine.load(model, version=0)
  traj = engine.rollout(params, prompts, group_size=8, key=jax.random.key(0))
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxroll.model.config import ModelConfig
from jaxroll.rollout import decode
from jaxroll.rollout.sampling import SamplingParams
from jaxroll.types import Trajectories

_MIN_PROMPT_BUCKET = 16


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass
class RolloutStats:
  """What the last `rollout` call did (for cost accounting)."""

  decode_steps: int = 0
  generate_calls: int = 0
  prefill_calls: int = 0
  prompts_prefilled: int = 0
  tokens_generated: int = 0
  num_slots: int = 1

  @property
  def slot_utilisation(self) -> float:
    """Generated tokens over slot-steps: 1.0 means no slot ever sat idle."""
    return self.tokens_generated / max(1, self.decode_steps * self.num_slots)


class RolloutEngine:
  """Prefill / insert / generate over B slots, and a continuous-batching `rollout`.

  Args:
    cfg: the model config.
    graphdef: the model's NNX graph definition (`nnx.split(model)[0]`).
    num_slots: B, rows decoded together.
    max_prompt_len: longest request (prompt plus carried prefix) accepted.
    max_new_tokens: L, the most tokens generated per row.
    sampling: temperature / top-k / top-p.
    stop_token_ids: tokens that end a row (kept in its output).
    cache_dtype: KV-cache dtype; defaults to the model's compute dtype.
    refill_fraction: while requests are waiting, the decode loop hands back
      control once this fraction of the slots (at least one) is free.
    mesh: optional device mesh (jaxroll.sharding.make_mesh). The decode
      state's slots are split over its batch axes (data parallelism over
      rows); parameters keep whatever layout `load` receives them in.
  """

  def __init__(self, cfg: ModelConfig, graphdef, *, num_slots: int, max_prompt_len: int,
               max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
               stop_token_ids: Sequence[int] = (), cache_dtype=None,
               refill_fraction: float = 0.125, mesh=None):
    if num_slots <= 0 or max_prompt_len <= 0 or max_new_tokens <= 0:
      raise ValueError("num_slots, max_prompt_len and max_new_tokens must be positive")
    for t in stop_token_ids:
      if not 0 <= t < cfg.vocab_size:
        raise ValueError(f"stop token id {t} is outside the vocabulary [0, {cfg.vocab_size})")
    if not 0.0 < refill_fraction <= 1.0:
      raise ValueError(f"refill_fraction must be in (0, 1], got {refill_fraction}")
    self.cfg = cfg
    self.graphdef = graphdef
    self.num_slots = num_slots
    self.max_prompt_len = max_prompt_len
    self.max_new_tokens = max_new_tokens
    self.cache_len = max_prompt_len + max_new_tokens
    self.sampling = sampling
    self.stop_ids = jnp.asarray(list(stop_token_ids), jnp.int32).reshape(-1)
    self.cache_dtype = cache_dtype or cfg.jnp_dtype
    self.refill_every = max(1, int(refill_fraction * num_slots))
    self.mesh = mesh
    self.last_stats = RolloutStats()
    self._prepare = jax.jit(functools.partial(decode.prepare_params, graphdef=graphdef))
    self._prefill = jax.jit(functools.partial(decode.prefill, graphdef))
    # The decode state is replaced by every call: donating it lets XLA update
    # the KV cache in place instead of holding two copies.
    self._insert = jax.jit(decode.insert, donate_argnums=(0,))
    self._generate = jax.jit(functools.partial(decode.generate, graphdef, sampling),
                             donate_argnums=(1,))

  @classmethod
  def for_model(cls, model: nnx.Module, **kwargs) -> "RolloutEngine":
    graphdef, _ = nnx.split(model)
    return cls(model.cfg, graphdef, **kwargs)

  # -- the four engine operations ------------------------------------------

  def load(self, model_or_state, version: int = 0) -> decode.DecodeParams:
    """Weights in decode layout, tagged with their policy version."""
    state = model_or_state
    if isinstance(model_or_state, nnx.Module):
      _, state = nnx.split(model_or_state)
    return self._prepare(state, version=jnp.int32(version))

  def init_decode_state(self) -> decode.DecodeState:
    state = decode.init_decode_state(self.cfg, self.num_slots, self.cache_len,
                                     self.max_new_tokens, self.cache_dtype)
    if self.mesh is None:
      return state
    from jaxroll import sharding  # only sharded engines need it

    # Every leaf of the decode state is indexed by slot first.
    return jax.tree.map(lambda x: jax.device_put(
        x, sharding.batch_sharding(self.mesh, x.ndim, rows=self.num_slots)), state)

  def prefill(self, params: decode.DecodeParams, requests: Sequence[Sequence[int]]) -> decode.Prefix:
    """Prefills requests (token lists), padded to a (P, T) bucket.

    Rows of the returned prefix past len(requests) are padding.
    """
    self.validate_requests(requests)
    if len(requests) > self.num_slots:
      raise ValueError(f"prefill of {len(requests)} requests exceeds the {self.num_slots} slots")
    longest = max(len(r) for r in requests)
    T = min(max(_MIN_PROMPT_BUCKET, _next_pow2(longest)), self.max_prompt_len)
    P = min(_next_pow2(len(requests)), _next_pow2(self.num_slots))
    tokens = np.zeros((P, T), np.int32)
    lengths = np.ones((P,), np.int32)
    for i, r in enumerate(requests):
      tokens[i, :len(r)] = r
      lengths[i] = len(r)
    self.last_stats.prefill_calls += 1
    self.last_stats.prompts_prefilled += len(requests)
    return self._prefill(params, jnp.asarray(tokens), jnp.asarray(lengths))

  def insert(self, state: decode.DecodeState, prefix: decode.Prefix, slots: Sequence[int],
             rows: Sequence[int], keys: jax.Array, max_new_tokens: Optional[Sequence[int]] = None):
    """Puts prefix rows into slots; each (slot, row) pair starts one sample.

    Args:
      keys: one PRNG key per pair; a row's tokens depend only on its key.
      max_new_tokens: per pair, at most the engine's max_new_tokens.
    """
    B = self.num_slots
    M = len(slots)
    if M > B:
      raise ValueError(f"batch of {M} rows is larger than the engine's {B} slots")
    if len(rows) != M or keys.shape[0] != M:
      raise ValueError("slots, rows and keys must have the same length")
    if any(not 0 <= s < B for s in slots) or len(set(slots)) != M:
      raise ValueError(f"slots must be distinct indices in [0, {B}), got {list(slots)}")
    P = prefix.length_P.shape[0]
    if any(not 0 <= r < P for r in rows):
      raise ValueError(f"prefix rows must be in [0, {P})")
    limit = np.full((M,), self.max_new_tokens, np.int32) if max_new_tokens is None else np.asarray(max_new_tokens, np.int32)
    if np.any(limit < 1) or np.any(limit > self.max_new_tokens):
      raise ValueError(f"max_new_tokens must be in [1, {self.max_new_tokens}]")
    # Pad to B pairs so insert compiles once per prefix shape; slot B is skipped.
    slot_B = np.full((B,), B, np.int32)
    slot_B[:M] = slots
    row_B = np.zeros((B,), np.int32)
    row_B[:M] = rows
    max_new_B = np.ones((B,), np.int32)
    max_new_B[:M] = limit
    key_B = jnp.concatenate([keys, jax.random.split(jax.random.key(0), B - M)]) if M < B else keys
    return self._insert(state, prefix, jnp.asarray(slot_B), jnp.asarray(row_B), key_B,
                        jnp.asarray(max_new_B))

  def generate(self, params: decode.DecodeParams, state: decode.DecodeState, *,
               max_steps: Optional[int] = None, exit_when_free: Optional[int] = None):
    """Decodes inside one while_loop; returns (state, steps run).

    Stops when no row is live, after `max_steps`, or once `exit_when_free`
    slots are free (default: never early).
    """
    max_steps = self.max_new_tokens if max_steps is None else max_steps
    exit_when_free = self.num_slots + 1 if exit_when_free is None else exit_when_free
    state, steps = self._generate(params, state, self.stop_ids, jnp.int32(max_steps),
                                  jnp.int32(exit_when_free))
    return state, steps

  # -- the RL entry point ---------------------------------------------------

  def validate_requests(self, requests: Sequence[Sequence[int]]) -> None:
    """Raises ValueError naming the first bad request; nothing is started."""
    if len(requests) == 0:
      raise ValueError("no prompts given")
    V = self.cfg.vocab_size
    for i, r in enumerate(requests):
      n = len(r)
      if n == 0:
        raise ValueError(f"prompt {i} is empty; every request needs at least one token")
      if n > self.max_prompt_len:
        raise ValueError(
            f"prompt {i} has {n} tokens but the KV cache holds {self.max_prompt_len} prompt "
            f"tokens (+{self.max_new_tokens} new); raise max_prompt_len")
      arr = np.asarray(r)
      if arr.min() < 0 or arr.max() >= V:
        bad = int(arr[(arr < 0) | (arr >= V)][0])
        raise ValueError(f"prompt {i} has token id {bad} outside the vocabulary [0, {V})")

  def rollout(self, params: decode.DecodeParams, prompts: Sequence[Sequence[int]], *,
              group_size: int = 1, key: Optional[jax.Array] = None,
              row_keys: Optional[jax.Array] = None,
              max_new_tokens: Optional[int] = None) -> Trajectories:
    """Samples `group_size` completions of every prompt.

    Any number of rows is accepted: they enter the B slots as earlier rows
    finish. Each prompt is prefilled once, and its KV copied into the slots
    of its samples.

    Args:
      params: from `load`.
      prompts: token-id lists.
      group_size: G samples per prompt; row n belongs to prompt n // G.
      key: PRNG key; row n samples with `fold_in(key, n)`.
      row_keys: alternatively, one key per row (N = P * G).
      max_new_tokens: per-call limit, at most the engine's.

    Returns:
      Trajectories of N = P * G rows in request order.
    """
    self.validate_requests(prompts)
    if group_size < 1:
      raise ValueError(f"group_size must be >= 1, got {group_size}")
    P, G, B, L = len(prompts), group_size, self.num_slots, self.max_new_tokens
    N = P * G
    limit = L if max_new_tokens is None else max_new_tokens
    if not 1 <= limit <= L:
      raise ValueError(f"max_new_tokens={limit} must be in [1, {L}] (the engine's bucket)")
    if row_keys is None:
      if key is None:
        raise ValueError("pass key or row_keys")
      row_keys = jax.vmap(lambda n: jax.random.fold_in(key, n))(jnp.arange(N))
    elif row_keys.shape[0] != N:
      raise ValueError(f"row_keys has {row_keys.shape[0]} keys for {N} rows")

    stats = self.last_stats = RolloutStats(num_slots=B)
    out = {name: np.zeros((N, L), dt) for name, dt in
           (("tokens", np.int32), ("logp", np.float32), ("pos", np.int32), ("version", np.int32))}
    length_N = np.zeros((N,), np.int32)
    finish_N = np.zeros((N,), np.int32)

    state = self.init_decode_state()
    pending = collections.deque(range(N))
    free = list(range(B))
    slot_row = {}  # slot -> row it decodes
    prefixes = {}  # chunk start prompt -> Prefix
    chunk = B  # prompts per prefill call

    while pending or slot_row:
      if pending and free:
        take = [pending.popleft() for _ in range(min(len(free), len(pending)))]
        by_chunk = collections.defaultdict(list)
        for n in take:
          by_chunk[(n // G) // chunk * chunk].append(n)
        for start, rows in sorted(by_chunk.items()):
          if start not in prefixes:
            prefixes[start] = self.prefill(params, prompts[start:start + chunk])
          slots = [free.pop() for _ in rows]
          state = self.insert(state, prefixes[start], slots, [n // G - start for n in rows],
                              row_keys[np.asarray(rows)], [limit] * len(rows))
          slot_row.update(zip(slots, rows))
          # Rows are taken in order, so once a chunk's last row is in a slot
          # its prefix is no longer needed.
          if min(N, (start + chunk) * G) - 1 in rows:
            del prefixes[start]
      n_free = B - len(slot_row)
      exit_when_free = n_free + min(len(pending), self.refill_every) if pending else B + 1
      state, steps = self.generate(params, state, max_steps=L, exit_when_free=exit_when_free)
      stats.generate_calls += 1
      stats.decode_steps += int(steps)
      done_B, count_B, finish_B, toks, logp, pos, ver = jax.device_get(
          (state.done_B, state.count_B, state.finish_B, state.out_tokens_BxL,
           state.out_logp_BxL, state.out_pos_BxL, state.out_version_BxL))
      for s in [s for s in slot_row if done_B[s]]:
        n = slot_row.pop(s)
        length_N[n], finish_N[n] = count_B[s], finish_B[s]
        out["tokens"][n], out["logp"][n] = toks[s], logp[s]
        out["pos"][n], out["version"][n] = pos[s], ver[s]
        free.append(s)
    mask = np.arange(L)[None, :] < length_N[:, None]
    for buf in out.values():
      buf[~mask] = 0
    stats.tokens_generated = int(length_N.sum())
    return Trajectories(
        prompt_index_N=(np.arange(N) // G).astype(np.int32),
        sample_index_N=(np.arange(N) % G).astype(np.int32),
        tokens_NxL=out["tokens"], logp_NxL=out["logp"], position_NxL=out["pos"],
        version_NxL=out["version"], length_N=length_N, finish_N=finish_N)
