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
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxroll import host_memory
from jaxroll.model import transformer
from jaxroll.model.config import ModelConfig
from jaxroll.model.paged_kv_cache import PagedSpec, pages_for
from jaxroll.rollout import decode, decode_params
from jaxroll.rollout.draft_history import DraftHistory
from jaxroll.rollout.live_rows import LiveDecode
from jaxroll.rollout.sampling import SEED_COMPILE_OPTIONS, SamplingParams, folded_row_seeds, row_seeds
from jaxroll.rollout.speculative import SpeculativeSpec
from jaxroll.scheduling.admission import FixedOrder
from jaxroll.types import FINISH_LENGTH, FINISH_PREEMPTED, FINISH_RUNNING, Trajectories

_MIN_PROMPT_BUCKET = 16
# Rows per prefill of resumed rows (carried or preempted; see `_admit`).
_RESUME_CHUNK_ROWS = 8


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
  finish_step_N: Optional[np.ndarray] = None  # decode step at which each row finished
  interrupted: bool = False  # `interrupt` stopped decoding with rows unfinished
  # Speculative decoding: forward passes rows took part in while live,
  # tokens drafted, and drafted tokens emitted (0 without speculation).
  row_forwards: int = 0
  drafted: int = 0
  accepted: int = 0
  # KV memory: the most bytes the cache held for rows at once (a dense
  # cache holds every slot at full length), the most rows in slots at once,
  # and (paged) rows that lost their pages and were prefilled again.
  kv_peak_bytes: int = 0
  peak_rows: int = 0
  preemptions: int = 0

  @property
  def slot_utilisation(self) -> float:
    """Row forward passes over slot-steps: 1.0 means no slot ever sat idle."""
    forwards = self.row_forwards or self.tokens_generated
    return forwards / max(1, self.decode_steps * self.num_slots)

  @property
  def tokens_per_forward(self) -> float:
    """Generated tokens per row forward pass (1.0 without speculation)."""
    return self.tokens_generated / max(1, self.row_forwards or self.tokens_generated)

  @property
  def acceptance_rate(self) -> float:
    """Drafted tokens emitted over tokens drafted (0 when nothing was drafted)."""
    return self.accepted / max(1, self.drafted)


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
    speculative: draft and verify several tokens per step
      (jaxroll.rollout.speculative); None decodes one token per step. The
      sampled distribution is the same either way.
    history_per_prompt: with speculation, earlier responses kept per
      prompt as drafts (`history`, saved with the run by its owner).
    paged: a paged KV cache (jaxroll.model.paged_kv_cache.PagedSpec):
      pages taken as rows grow, a group's prompt pages shared by its
      samples, attention over live pages only, optionally sparse. With a
      pool smaller than every slot at full length, rows are admitted while
      pages are free and preempted (then resumed) when they run out.
    live_rows: a decode step runs the model over its live rows only
      (jaxroll.rollout.live_forward): in a long-tailed batch most steps
      have few. Off with a mesh (gathering rows would move them between
      devices) and with a paged cache (which reads live pages only).
    cache_window: a decode step's attention reads the cache only as far
      as its live rows have got (a few static windows: S, S/2, S/4, S/8).
      Off with a paged cache. Each of these makes a row's numbers depend
      on its batch mates at float32 rounding; both off: bit for bit
      independent.
  """

  def __init__(self, cfg: ModelConfig, graphdef, *, num_slots: int, max_prompt_len: int,
               max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
               stop_token_ids: Sequence[int] = (), cache_dtype=None,
               refill_fraction: float = 0.125, mesh=None,
               speculative: Optional[SpeculativeSpec] = None, history_per_prompt: int = 4,
               paged: Optional[PagedSpec] = None, live_rows: bool = True,
               cache_window: bool = True):
    if num_slots <= 0 or max_prompt_len <= 0 or max_new_tokens <= 0:
      raise ValueError("num_slots, max_prompt_len and max_new_tokens must be positive")
    for t in stop_token_ids:
      if not 0 <= t < cfg.vocab_size:
        raise ValueError(f"stop token id {t} is outside the vocabulary [0, {cfg.vocab_size})")
    if not 0.0 < refill_fraction <= 1.0:
      raise ValueError(f"refill_fraction must be in (0, 1], got {refill_fraction}")
    if speculative is not None and speculative.layer_skip >= cfg.num_layers:
      raise ValueError(f"the layer-skip drafter exits after {speculative.layer_skip} layers, but the "
                       f"policy has {cfg.num_layers}: use fewer (1 .. {cfg.num_layers - 1})")
    if paged is not None and mesh is not None:
      raise ValueError("a paged KV cache is not yet sharded over a mesh: its page pool is shared "
                       "by all slots; use the dense cache (no `paged`) with a mesh")
    self.cfg = cfg
    self.graphdef = graphdef
    # The engine compiles a few large programs; their scratch memory goes
    # back to the OS instead of sitting under the weights.
    host_memory.release_after_compiles()
    self.paged = paged
    self.num_slots = num_slots
    self.max_prompt_len = max_prompt_len
    self.max_new_tokens = max_new_tokens
    self.speculative = speculative
    # A verifying pass writes k draft positions past the row's last one.
    self.cache_len = max_prompt_len + max_new_tokens + (speculative.k if speculative else 0)
    self.history = DraftHistory(history_per_prompt) if speculative else None
    self.sampling = sampling
    self.stop_ids = jnp.asarray(list(stop_token_ids), jnp.int32).reshape(-1)
    self.cache_dtype = cache_dtype or cfg.jnp_dtype
    self.refill_every = max(1, int(refill_fraction * num_slots))
    self.mesh = mesh
    self.last_stats = RolloutStats()
    self._prefill = jax.jit(functools.partial(decode.prefill, graphdef))
    # The decode state is replaced by every call: donating it lets XLA update
    # the KV cache in place instead of holding two copies.
    self._insert = jax.jit(decode.insert, donate_argnums=(0,))
    self._row_seeds = jax.jit(row_seeds, compiler_options=SEED_COMPILE_OPTIONS)
    self._key_seeds = jax.jit(folded_row_seeds, compiler_options=SEED_COMPILE_OPTIONS)
    self._init_state = jax.jit(functools.partial(
        decode.init_decode_state, cfg, num_slots, self.cache_len, max_new_tokens, self.cache_dtype,
        speculative, paged))
    self.num_pages = 0  # KV pages in the pool (paged cache only)
    if paged is not None:
      self.pages_per_row = pages_for(self.cache_len, paged.page_size)
      self.num_pages = paged.num_pages if paged.num_pages is not None else num_slots * self.pages_per_row
      if self.num_pages < self.pages_per_row:
        raise ValueError(f"a pool of {self.num_pages} KV pages cannot hold one full row "
                         f"({self.pages_per_row} pages of {paged.page_size}); raise num_pages")
    # KV bytes per position (all layers, keys and values).
    itemsize = jnp.dtype(self.cache_dtype).itemsize
    self.kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    self.live_rows = live_rows and mesh is None and paged is None
    self.cache_window = cache_window and paged is None
    live = LiveDecode(rows=self.live_rows, window=self.cache_window)
    self._generate = jax.jit(functools.partial(decode.generate, graphdef, sampling, spec=speculative,
                                               live=live), donate_argnums=(1,))
    self._rope_table = self._make_rope_table()

  def _make_rope_table(self):
    """cos and sin of the rotary angles at every cache position, once per
    engine (decode_params.DecodeParams.rope_table). The positions are an
    argument, not a constant, so XLA computes the table at run time with the
    same cos and sin the model's own forward uses, instead of folding it at
    compile time."""
    positions = np.arange(self.cache_len, dtype=np.int32)
    table = jax.jit(functools.partial(transformer.rope_cos_sin, self.cfg))(positions)
    if self.mesh is None:
      return table
    from jaxroll import sharding  # only sharded engines need it

    return jax.device_put(table, sharding.replicated(self.mesh))

  @classmethod
  def for_model(cls, model: nnx.Module, **kwargs) -> "RolloutEngine":
    graphdef, _ = nnx.split(model)
    return cls(model.cfg, graphdef, **kwargs)

  # -- the four engine operations ------------------------------------------

  def load(self, model_or_state, version: int = 0, dtype=None, residual=None,
           head_ExV=None, kv_budget=None) -> decode.DecodeParams:
    """Weights in decode layout, tagged with their policy version.

    The state's arrays are used as they are, not copied: a caller that
    goes on to donate or overwrite them (an update that donates the
    trainer's weights while this engine still samples) passes a copy.

    residual: R2PO's rollout head (decode.DecodeParams.residual), or None.

    head_ExV: the [E, V] output head when the caller has it in that layout
    already (`jaxroll.model.hf_import.load_hf_decode_weights`); otherwise
    the model's own (a tied embedding is transposed once here).

    kv_budget: the share of live pages sparse attention keeps when decoding
    with these weights (a paged cache with sparsity); None: the spec's.

    dtype: cast floating-point weights to it (a bfloat16 sampler for a
    float32 trainer, as in systems whose inference engine runs in lower
    precision); the sampled tokens' log-probs then differ from the
    trainer's, which `rl.measure_mismatch` reports.
    """
    state = model_or_state
    if isinstance(model_or_state, nnx.Module):
      _, state = nnx.split(model_or_state)
    if dtype is not None:
      cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
      state = jax.tree.map(cast, state)
      head_ExV = None if head_ExV is None else cast(head_ExV)
    if kv_budget is not None and (self.paged is None or self.paged.sparsity == "none"):
      raise ValueError("kv_budget applies to sparse attention over a paged cache: this engine has none")
    return decode_params.make_params(self.graphdef, state, version, residual=residual,
                                     head_ExV=head_ExV, kv_budget=kv_budget,
                                     rope_table=self._rope_table)

  def compile_ahead(self, state, head_ExV=None, *, num_prompts: Optional[int] = None,
                    prompt_len: Optional[int] = None) -> None:
    """Compiles the decode loop and the prefill for weights shaped like
    `state` and `head_ExV` (as `load` takes them; jax.ShapeDtypeStruct
    leaves do, e.g. from `jaxroll.model.hf_import.hf_decode_weight_shapes`)
    before any weight is in memory, so the compiler's scratch memory never
    sits on top of the weights (the process's peak), and the first rollout
    does not wait for them. The prefill is compiled for `num_prompts`
    prompts (default: the slots) of up to `prompt_len` tokens (default:
    the engine's longest); other prompt counts and lengths compile when
    they first come. Weights loaded later must match in shape and dtype,
    or they compile anew. Single-device engines only (a mesh engine's
    programs depend on how its weights are laid out over the mesh)."""
    if self.mesh is not None:
      raise ValueError("compile_ahead is for an engine without a mesh; a sharded engine "
                       "compiles at its first rollout")
    params = jax.eval_shape(lambda s, h: self.load(s, head_ExV=h), state, head_ExV)
    decode_state = jax.eval_shape(self._init_state)
    self._generate.lower(params, decode_state, self.stop_ids, np.int32(0), np.int32(0),
                         *self._no_group_stop()).compile()
    P = min(_next_pow2(num_prompts or self.num_slots), _next_pow2(self.num_slots))
    T = min(max(_MIN_PROMPT_BUCKET, _next_pow2(prompt_len or self.max_prompt_len)), self.max_prompt_len)
    prompts = jax.ShapeDtypeStruct((P, T), jnp.int32)
    self._prefill.lower(params, prompts, jax.ShapeDtypeStruct((P,), jnp.int32)).compile()

  def init_decode_state(self) -> decode.DecodeState:
    state = self._init_state()
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
    return self._prefill_padded(params, requests, self.max_prompt_len)

  def _prefill_padded(self, params, requests, max_len: int, rows: Optional[int] = None) -> decode.Prefix:
    """Prefills at a (P, T) bucket: T the longest request's power of two,
    P the count's (or `rows`, a fixed chunk of at least len(requests))."""
    if len(requests) > self.num_slots:
      raise ValueError(f"prefill of {len(requests)} requests exceeds the {self.num_slots} slots")
    longest = max(len(r) for r in requests)
    T = min(max(_MIN_PROMPT_BUCKET, _next_pow2(longest)), max_len)
    P = min(_next_pow2(len(requests)), _next_pow2(self.num_slots)) if rows is None else rows
    tokens = np.zeros((P, T), np.int32)
    lengths = np.ones((P,), np.int32)
    for i, r in enumerate(requests):
      tokens[i, :len(r)] = r
      lengths[i] = len(r)
    self.last_stats.prefill_calls += 1
    self.last_stats.prompts_prefilled += len(requests)
    return self._prefill(params, tokens, lengths)

  def insert(self, state: decode.DecodeState, prefix: decode.Prefix, slots: Sequence[int],
             rows: Sequence[int], keys: Optional[jax.Array],
             max_new_tokens: Optional[Sequence[int]] = None,
             counts: Optional[Sequence[int]] = None, seeds: Optional[np.ndarray] = None,
             sources: Optional[np.ndarray] = None, groups: Optional[Sequence[int]] = None):
    """Puts prefix rows into slots; each (slot, row) pair starts one sample.

    Args:
      keys: one PRNG key per pair; a row's tokens depend only on its key.
      max_new_tokens: per pair, at most the engine's max_new_tokens.
      counts: per pair, tokens already generated (a resumed row, whose
        prefix ends with them); 0 by default.
      seeds: instead of keys, the rows' sampling seeds (`row_seeds(keys)`),
        as the rollout loop passes them: host arrays, so no per-call gather.
      sources: with speculation, per pair the history draft source
        ([M, spec.source_tokens], `DraftHistory.source`); none by default.
      groups: with speculation, per pair its group (rows of one group draft
        from each other); none by default.
    """
    B = self.num_slots
    M = len(slots)
    if M > B:
      raise ValueError(f"batch of {M} rows is larger than the engine's {B} slots")
    if len(rows) != M or (keys if seeds is None else seeds).shape[0] != M:
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
    count_B = np.zeros((B,), np.int32)
    if counts is not None:
      count_B[:M] = counts
      if np.any(count_B[:M] < 0) or np.any(count_B[:M] >= max_new_B[:M]):
        raise ValueError("counts must be in [0, max_new_tokens) for every resumed row")
    seed_Bx2 = np.zeros((B, 2), np.uint32)
    seed_Bx2[:M] = np.asarray(self._row_seeds(keys)) if seeds is None else seeds
    # Host arrays go to the jitted call as they are: one transfer with the
    # call instead of a dispatched op per conversion.
    if self.speculative is None:
      return self._insert(state, prefix, slot_B, row_B, seed_Bx2, max_new_B, count_B)
    R = state.spec.src_BxR.shape[1]
    src_BxR = np.full((B, R), -1, np.int32)
    if sources is not None and self.speculative.history:
      src_BxR[:M] = sources
    group_B = np.full((B,), -1, np.int32)
    if groups is not None:
      group_B[:M] = groups
    return self._insert(state, prefix, slot_B, row_B, seed_Bx2, max_new_B, count_B, src_BxR,
                        group_B, self.speculative.k)

  def generate(self, params: decode.DecodeParams, state: decode.DecodeState, *,
               max_steps: Optional[int] = None, exit_when_free: Optional[int] = None,
               group_B: Optional[np.ndarray] = None, groups_needed: Optional[int] = None):
    """Decodes inside one while_loop; returns (state, steps run).

    Stops when no row is live, after `max_steps`, once `exit_when_free`
    slots are free (default: never early), or once `groups_needed` of the
    groups labelling slots in `group_B` (decode.complete_groups) have no
    live slot (default: never).
    """
    max_steps = self.max_new_tokens if max_steps is None else max_steps
    exit_when_free = self.num_slots + 1 if exit_when_free is None else exit_when_free
    groups = self._no_group_stop() if group_B is None else (np.asarray(group_B, np.int32),
                                                            np.int32(groups_needed))
    state, steps = self._generate(params, state, self.stop_ids, np.int32(max_steps),
                                  np.int32(exit_when_free), *groups)
    return state, steps

  def _no_group_stop(self):
    # Every slot unlabelled and more groups needed than slots: never stops.
    B = self.num_slots
    return np.full((B,), B, np.int32), np.int32(B + 1)

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
              row_seeds: Optional[np.ndarray] = None,
              max_new_tokens: Optional[int] = None,
              carried: Optional[Trajectories] = None,
              admission=None,
              stop_after_groups: Optional[int] = None,
              interrupt: Optional[Callable[[], bool]] = None,
              interrupt_every: int = 4) -> Trajectories:
    """Samples `group_size` completions of every prompt.

    Any number of rows is accepted: they enter the B slots as earlier rows
    finish, in the order `admission` chooses. Each prompt is prefilled once,
    and its KV copied into the slots of its samples.

    Partial rollout: with `stop_after_groups=k` decoding stops as soon as k
    groups have all their rows finished (APRIL's over-provisioning); rows
    still decoding come back with finish code FINISH_RUNNING and the tokens
    they have so far, and rows never admitted with none. Passing such a
    result back as `carried` resumes it: finished rows are kept as they are,
    and each unfinished row continues under `params`, its prompt and tokens
    so far prefilled again under these weights (the old KV belongs to the
    old weights), sampling where its key's stream left off. Every token
    keeps the log-prob and policy version it was sampled with.

    Args:
      params: from `load`.
      prompts: token-id lists.
      group_size: G samples per prompt; row n belongs to prompt n // G.
      key: PRNG key; row n samples with `fold_in(key, n)`.
      row_keys: alternatively, one key per row (N = P * G).
      row_seeds: or the rows' sampling seeds (`sampling.row_seeds` of their
        keys, [N, 2] uint32 on the host): no per-call seed computation,
        whose shape would follow N (a caller whose N varies computes them
        once, at a fixed shape).
      max_new_tokens: per-call limit on a row's total generated tokens, at
        most the engine's. A carried row already at the limit finishes as
        FINISH_LENGTH without decoding.
      carried: an earlier result for the same prompts, group size and keys.
      admission: the order rows enter slots (jaxroll.scheduling.admission);
        it covers the rows to decode (a subset of the unfinished rows
        decodes only those). Default: every unfinished row, in row order.
      stop_after_groups: stop once this many groups are complete.
      interrupt: checked every `interrupt_every` decode steps (at most);
        when it returns True decoding stops as for `stop_after_groups`, so
        the caller can resume the unfinished rows under newer weights
        (AReaL's interruptible rollout).

    Returns:
      Trajectories of N = P * G rows in request order. `last_stats` has the
      decode step at which each row finished (`finish_step_N`, -1 if not).
    """
    self.validate_requests(prompts)
    if group_size < 1:
      raise ValueError(f"group_size must be >= 1, got {group_size}")
    P, G, B, L = len(prompts), group_size, self.num_slots, self.max_new_tokens
    N = P * G
    limit = L if max_new_tokens is None else max_new_tokens
    if not 1 <= limit <= L:
      raise ValueError(f"max_new_tokens={limit} must be in [1, {L}] (the engine's bucket)")
    if row_seeds is not None:
      if np.shape(row_seeds) != (N, 2):
        raise ValueError(f"row_seeds has shape {np.shape(row_seeds)}, expected {(N, 2)}")
    elif row_keys is None:
      if key is None:
        raise ValueError("pass key, row_keys or row_seeds")
      # One compiled call (per N) instead of tracing a vmap on every call.
      row_seeds = self._key_seeds(key, np.arange(N, dtype=np.int32))
    elif row_keys.shape[0] != N:
      raise ValueError(f"row_keys has {row_keys.shape[0]} keys for {N} rows")
    if stop_after_groups is not None and not 1 <= stop_after_groups <= P:
      raise ValueError(f"stop_after_groups={stop_after_groups} must be in [1, {P}] (the groups given)")

    # Every row's sampling seed, once per call: admissions index a host array.
    seed_Nx2 = (np.asarray(row_seeds, np.uint32) if row_seeds is not None
                else np.asarray(self._row_seeds(row_keys)))
    stats = self.last_stats = RolloutStats(num_slots=B)
    out, length_N, finish_N = self._start_buffers(carried, N, L)
    # A carried row already at this call's limit is finished by it.
    at_limit = (finish_N == FINISH_RUNNING) & (length_N >= limit)
    finish_N[at_limit] = FINISH_LENGTH
    todo = [n for n in range(N) if finish_N[n] == FINISH_RUNNING]
    if admission is None:
      admission = FixedOrder(todo)
    elif sorted(admission.rows) != todo:
      # A subset decodes only those rows (the rest come back as they were):
      # how a plan draws fewer samples for some prompts than for others.
      if stop_after_groups is not None or len(set(admission.rows)) != len(admission.rows) \
          or not set(admission.rows) <= set(todo):
        raise ValueError("the admission policy must cover exactly the rows still to decode "
                         f"({len(todo)} rows), or distinct ones of them without stop_after_groups")
      todo = sorted(admission.rows)
    start_N = length_N.copy()  # tokens each row had before this call
    finish_step_N = np.where(finish_N != FINISH_RUNNING, 0, -1).astype(np.int32)
    admit_step_N = np.zeros((N,), np.int32)
    left_P = np.bincount(np.asarray(todo, np.int64) // G, minlength=P)  # unfinished rows per group
    goal = P if stop_after_groups is None else stop_after_groups
    fresh_left = collections.Counter(n // G for n in todo if start_N[n] == 0)
    prefixes = {}  # prompt -> (Prefix, row in it), for rows not yet admitted

    state = self.init_decode_state()
    free = list(range(B))
    slot_row = {}  # slot -> row it decodes
    # Paged cache: rows that lost their pages wait here, ahead of new rows.
    pending, preempted = collections.deque(), set()
    admitted_N = length_N.copy()  # tokens a row had when it entered its slot
    self._free_pages = self.num_pages
    while (len(admission) or pending or slot_row) and np.sum(left_P == 0) < goal:
      if (len(admission) or pending) and free:
        rows = [pending.popleft() for _ in range(min(len(pending), len(free)))]
        rows += admission.take(len(free) - len(rows))
        if self.paged is not None:
          rows, back = self._fit_pages(rows, prompts, G, length_N, preempted, len(slot_row))
          pending.extendleft(reversed(back))
        if rows:
          admit_step_N[rows] = stats.decode_steps
          admitted_N[rows] = length_N[rows]
          state = self._admit(params, state, prompts, G, rows, admission, free, slot_row, prefixes,
                              fresh_left, length_N, preempted, out, seed_Nx2, limit)
        elif not slot_row:
          raise RuntimeError("no KV pages free with every slot empty")  # pool >= one full row
        stats.peak_rows = max(stats.peak_rows, len(slot_row))
      n_free = B - len(slot_row)
      waiting = len(admission) + len(pending)
      if waiting:
        exit_when_free = n_free + min(waiting, self.refill_every)
      else:
        exit_when_free = B + 1
      group_stop = {}
      if not waiting and stop_after_groups is not None:
        # Every unfinished row is in a slot: the loop itself stops once the
        # goal's remaining groups are complete, with no return per finish.
        label = {}
        group_B = np.full((B,), B, np.int32)
        for s, n in slot_row.items():
          group_B[s] = label.setdefault(n // G, len(label))
        group_stop = dict(group_B=group_B, groups_needed=goal - int(np.sum(left_P == 0)))
      chunk = L if interrupt is None else min(L, interrupt_every)
      state, steps = self.generate(params, state, max_steps=chunk, exit_when_free=exit_when_free,
                                   **group_stop)
      stats.generate_calls += 1
      stats.decode_steps += int(steps)
      done_B = self._harvest(state, slot_row, out, length_N, finish_N, admitted_N, only_done=True)
      for s, n, forwards, was_preempted in done_B:
        free.append(s)
        if was_preempted:  # back in line, resumed from its tokens so far
          pending.append(n)
          preempted.add(n)
          stats.preemptions += 1
          continue
        left_P[n // G] -= 1
        # A row takes part in every step from its admission until it stops.
        finish_step_N[n] = admit_step_N[n] + forwards
        admission.observe(n, int(length_N[n]))
      if interrupt is not None and (len(admission) or pending or slot_row) and interrupt():
        stats.interrupted = True  # rows remain: the caller resumes them
        break
    # Stopped early: rows still in slots come back unfinished, with their tokens so far.
    self._harvest(state, slot_row, out, length_N, finish_N, admitted_N, only_done=False)
    if self.paged is None:
      stats.kv_peak_bytes = B * self.cache_len * self.kv_bytes_per_token
    else:
      peak_pages = int(jax.device_get(state.cache.peak_used))
      stats.kv_peak_bytes = peak_pages * self.paged.page_size * self.kv_bytes_per_token
    mask = np.arange(L)[None, :] < length_N[:, None]
    for buf in out.values():
      buf[~mask] = 0
    stats.tokens_generated = int((length_N - start_N).sum())
    stats.finish_step_N = finish_step_N
    if self.history is not None:  # rows this call finished become drafts for later calls
      for n in todo:
        if finish_N[n] != FINISH_RUNNING:
          self.history.add(prompts[n // G], out["tokens"][n, :length_N[n]])
    return Trajectories(
        prompt_index_N=(np.arange(N) // G).astype(np.int32),
        sample_index_N=(np.arange(N) % G).astype(np.int32),
        tokens_NxL=out["tokens"], logp_NxL=out["logp"], position_NxL=out["pos"],
        version_NxL=out["version"], length_N=length_N, finish_N=finish_N)

  # -- rollout helpers --------------------------------------------------------

  @staticmethod
  def _start_buffers(carried: Optional[Trajectories], N: int, L: int):
    """Output buffers, starting from a carried result's rows when given."""
    if carried is None:
      out = {name: np.zeros((N, L), dt) for name, dt in
             (("tokens", np.int32), ("logp", np.float32), ("pos", np.int32), ("version", np.int32))}
      return out, np.zeros((N,), np.int32), np.zeros((N,), np.int32)
    if carried.tokens_NxL.shape != (N, L):
      raise ValueError(f"carried trajectories have shape {carried.tokens_NxL.shape}, "
                       f"expected {(N, L)} (same prompts, group size and engine)")
    out = {"tokens": carried.tokens_NxL.copy(), "logp": carried.logp_NxL.copy(),
           "pos": carried.position_NxL.copy(), "version": carried.version_NxL.copy()}
    return out, carried.length_N.astype(np.int32).copy(), carried.finish_N.astype(np.int32).copy()

  def _fit_pages(self, rows, prompts, G, length_N, preempted, rows_in_slots):
    """The leading `rows` whose KV pages are free now, and the rest.

    A row needs the pages its insert takes (a group's shared prompt pages
    once, one page of its own; a resumed row its whole prefix), plus one
    page of headroom for every row in a slot, so that admitting does not
    preempt at once.
    """
    page = self.paged.page_size
    budget = self._free_pages - rows_in_slots
    used, shared = 0, set()
    for i, n in enumerate(rows):
      p = n // G
      if length_N[n] == 0 and n not in preempted:
        need = 1 + ((len(prompts[p]) - 1) // page if p not in shared else 0)
        shared.add(p)
      else:
        need = (len(prompts[p]) + int(length_N[n]) - 1) // page + 1
      alone = i == 0 and rows_in_slots == 0  # an empty pool always fits one row
      if not alone and used + need + (i + 1) > budget:
        self._free_pages -= used
        return rows[:i], rows[i:]
      used += need
    self._free_pages -= used
    return rows, []

  def _admit(self, params, state, prompts, G, rows, admission, free, slot_row, prefixes,
             fresh_left, length_N, preempted, out, seed_Nx2, limit):
    """Inserts `rows` into free slots: new rows share their prompt's prefill,
    resumed rows (carried or preempted) are prefilled with their tokens so far."""
    fresh = [n for n in rows if length_N[n] == 0 and n not in preempted]
    resumed = [n for n in rows if length_N[n] > 0 or n in preempted]
    need = sorted({n // G for n in fresh} - prefixes.keys())
    if need:
      # Prefill the prompts of upcoming rows too, up to a full chunk of
      # slots: fewer prefill calls, and one prefill shape in steady state.
      for n in admission.upcoming():
        if len(need) >= self.num_slots:
          break
        p = n // G
        if length_N[n] == 0 and n not in preempted and p not in prefixes and p not in need:
          need.append(p)
      prefix = self.prefill(params, [prompts[p] for p in need])
      prefixes.update({p: (prefix, i) for i, p in enumerate(need)})
    batches = collections.defaultdict(list)  # id(prefix) -> rows, so one insert per prefix
    for n in fresh:
      batches[id(prefixes[n // G][0])].append(n)
    for batch in batches.values():
      prefix = prefixes[batch[0] // G][0]
      state = self._insert_rows(state, prefix, batch, [prefixes[n // G][1] for n in batch],
                                free, slot_row, seed_Nx2, limit, [0] * len(batch), prompts, G)
      for n in batch:
        fresh_left[n // G] -= 1
        if not fresh_left[n // G]:
          del prefixes[n // G]  # the prompt's last new row is in a slot
    # Resumed rows go in chunks of a fixed number of rows, longest first:
    # their count changes every step, and a prefill padded to the count's
    # power of two compiled a new (rows, length) prefill and insert each
    # time it changed (about a second each on 2 cores) and computed up to
    # 4x the rows' tokens; fixed chunks of rows sorted by length compile
    # once per length bucket and pad each chunk only to its own longest row.
    total = lambda n: len(prompts[n // G]) + int(length_N[n])
    resumed.sort(key=lambda n: (-total(n), n))
    rows_per_chunk = min(_RESUME_CHUNK_ROWS, _next_pow2(self.num_slots))
    for i in range(0, len(resumed), rows_per_chunk):
      chunk = resumed[i:i + rows_per_chunk]
      requests = [list(prompts[n // G]) + out["tokens"][n, :length_N[n]].tolist() for n in chunk]
      prefix = self._prefill_padded(params, requests, self.cache_len, rows=rows_per_chunk)
      state = self._insert_rows(state, prefix, chunk, range(len(chunk)), free, slot_row,
                                seed_Nx2, limit, [int(length_N[n]) for n in chunk], prompts, G)
    return state

  def _insert_rows(self, state, prefix, rows, prefix_rows, free, slot_row, seed_Nx2, limit, counts,
                   prompts, G):
    slots = [free.pop() for _ in rows]
    sources = groups = None
    if self.speculative is not None:
      groups = [n // G for n in rows]
      if self.speculative.history:
        cache = {}  # rows of one prompt share its source
        for p in set(groups):
          cache[p] = self.history.source(prompts[p], self.speculative.history_tokens)
          if self.speculative.global_tokens:
            cache[p] = np.concatenate([self.history.global_source(prompts[p], self.speculative.global_tokens),
                                       cache[p]])
        sources = np.stack([cache[p] for p in groups])
    state = self.insert(state, prefix, slots, list(prefix_rows), None, [limit] * len(rows), counts,
                        seeds=seed_Nx2[np.asarray(rows)], sources=sources, groups=groups)
    slot_row.update(zip(slots, rows))
    return state

  def _harvest(self, state, slot_row, out, length_N, finish_N, admitted_N, only_done: bool):
    """Copies rows out of their slots (finished ones, or all).

    Returns:
      [(slot, row, forwards, preempted)]: forwards is how many decode steps
      the row was live for in its slot (its token count without
      speculation); a preempted row is unfinished and must be resumed.
    """
    if not slot_row:
      return []
    spec = state.spec
    # One transfer for everything the host reads (free pages too, when paged).
    done_B, count_B, finish_B, toks, logp, pos, ver, counters, free_pages = jax.device_get(
        (state.done_B, state.count_B, state.finish_B, state.out_tokens_BxL,
         state.out_logp_BxL, state.out_pos_BxL, state.out_version_BxL,
         None if spec is None else (spec.forwards_B, spec.drafted_B, spec.accepted_B),
         None if self.paged is None else state.cache.num_free()))
    if free_pages is not None:
      self._free_pages = int(free_pages)
    taken = []
    for s, n in list(slot_row.items()):
      if not (done_B[s] or not only_done):
        continue
      del slot_row[s]
      c0, c = int(admitted_N[n]), int(count_B[s])
      forwards = c - c0
      if counters is not None:
        forwards = int(counters[0][s])
        self.last_stats.row_forwards += forwards
        self.last_stats.drafted += int(counters[1][s])
        self.last_stats.accepted += int(counters[2][s])
      was_preempted = bool(done_B[s]) and finish_B[s] == FINISH_PREEMPTED
      taken.append((s, n, forwards, was_preempted))
      # A resumed row's slot holds only what it generated since its admission.
      for name, buf in (("tokens", toks), ("logp", logp), ("pos", pos), ("version", ver)):
        out[name][n, c0:c] = buf[s, c0:c]
      length_N[n] = c
      finish_N[n] = finish_B[s] if done_B[s] and not was_preempted else FINISH_RUNNING
    return taken
