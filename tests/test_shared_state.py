"""The replicated replay state of a multi-process run (jaxroll.loop.shared_state).

Two processes are simulated in one: `distributed.gather_json` is replaced
by one that returns a second process's log beside this one's, so replaying
the gathered logs can be compared with calling the transforms directly, in
process order, on one state.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxroll import distributed
from jaxroll.loop import shared_state
from jaxroll.replay.protocol import chain, groups_from, uniform_plan
from jaxroll.replay import filtering, selection
from jaxroll.replay.state import init_replay, observe

Q, K, G = 6, 3, 4


def _transform():
  return chain(filtering.greso(target=0.25, step=0.3, floor=0.05), selection.drop_zero_variance_groups())


def _process_calls(seed: int):
  """One process's batch: a plan over K candidates, then select and observe
  of its K groups, as (name, arrays) calls and as direct applications."""
  rng = np.random.default_rng(seed)
  prompts = rng.choice(Q, K, replace=False).astype(np.int32)
  reward = (rng.random((K, G)) < [[0.0], [1.0], [0.5]]).astype(np.float32)  # all-wrong, all-right, mixed
  valid = np.ones((K, G), bool)
  length = rng.integers(1, 9, (K, G)).astype(np.int32)
  plan = uniform_plan(prompts, G, limit=K)
  g = groups_from(prompts, reward, valid)
  kp, ks = jax.random.key(seed), jax.random.key(100 + seed)
  log = [("plan", (*map(np.asarray, plan), shared_state.key_data(kp))),
         ("select", (*map(np.asarray, g), shared_state.key_data(ks))),
         ("observe", (prompts, reward, valid, length, np.int32(seed)))]

  def apply(t, replay, tstate):
    _, tstate = t.plan(plan, tstate, replay, kp)
    _, tstate = t.select(g, tstate, replay, ks)
    return observe(replay, jnp.asarray(prompts), jnp.asarray(reward), jnp.asarray(valid),
                   jnp.asarray(length), seed), tstate

  return log, apply


def _two_process_gather(other_log, digests=None):
  """gather_json as process 1 sees it: process 0's log first; digests as given (else its own twice)."""
  calls = []

  def gather(obj):
    calls.append(obj)
    if len(calls) == 1:
      return [[shared_state.encode_call(op) for op in other_log], obj]
    return digests or [obj, obj]

  return gather


def _equal(a, b):
  return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("rounds", [1, 3])
def test_replayed_logs_equal_the_calls_applied_in_process_order(monkeypatch, rounds):
  t = _transform()
  replay = init_replay(Q, group_size=G, max_new_tokens=8)
  shared = shared_state.SharedStates(t, replay, t.init(replay), version=0, keep=3)
  want = (replay, t.init(replay))
  for r in range(rounds):
    log0, apply0 = _process_calls(2 * r)
    log1, apply1 = _process_calls(2 * r + 1)
    want = apply1(t, *apply0(t, *want))
    monkeypatch.setattr(distributed, "gather_json", _two_process_gather(log0))
    shared.reconcile(log1, version=r + 1)
    assert _equal(shared.base(r + 1), want)
  # Both processes' groups are in the record, and GRESO's adaptation saw them.
  assert int(shared.base(rounds)[0].groups_Q.sum()) == 2 * K * rounds
  assert float(shared.base(rounds)[1][0].explore_hard) < 1.0
  # Versions older than `keep` are dropped; the newest stays.
  assert shared.latest == rounds
  if rounds == 3:
    with pytest.raises(KeyError):
      shared.base(0)
  # The checkpoint's arrays are host copies of the same state.
  assert _equal(shared.arrays(rounds), {"replay": want[0], "transform": want[1]})


def test_own_log_alone_differs_and_a_diverged_digest_is_an_error(monkeypatch):
  """Replaying only this process's writes (the mistake the gather prevents)
  gives another state; a digest that differs across processes stops the run."""
  t = _transform()
  replay = init_replay(Q, group_size=G, max_new_tokens=8)
  log0, _ = _process_calls(0)
  log1, apply1 = _process_calls(1)
  shared = shared_state.SharedStates(t, replay, t.init(replay), version=0, keep=3)
  monkeypatch.setattr(distributed, "gather_json", _two_process_gather(log0))
  shared.reconcile(log1, version=1)
  assert not _equal(shared.base(1), apply1(t, replay, t.init(replay)))
  shared = shared_state.SharedStates(t, replay, t.init(replay), version=0, keep=3)
  monkeypatch.setattr(distributed, "gather_json", _two_process_gather(log0, digests=["0" * 16, "1" * 16]))
  with pytest.raises(RuntimeError, match="diverged across processes"):
    shared.reconcile(log1, version=1)


def test_encoded_calls_round_trip_exactly():
  log, _ = _process_calls(3)
  for name, arrays in log:
    back_name, back = shared_state.decode_call(shared_state.encode_call((name, arrays)))
    assert back_name == name
    for a, b in zip(arrays, back):
      assert np.asarray(a).dtype == b.dtype and np.array_equal(a, b)
