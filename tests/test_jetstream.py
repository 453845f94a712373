"""The JetStream Engine API adapter, driven by JetStream's own orchestrator."""

import asyncio
import logging
import threading
import traceback

import jax
import numpy as np
import pytest

pytest.importorskip("jetstream.engine.engine_api")
_root_handlers, _root_level = list(logging.root.handlers), logging.root.level
from jetstream.core import orchestrator  # noqa: E402
from jetstream.core.proto import jetstream_pb2  # noqa: E402
from jetstream.engine import engine_api  # noqa: E402

from jaxroll.rollout import RolloutEngine, SamplingParams  # noqa: E402
from jaxroll.rollout.jetstream_engine import IdTokenizer, JetStreamEngine  # noqa: E402
from small_models import small_model  # noqa: E402

# The orchestrator module configures the root logger at import: DEBUG, with a
# handler on the sys.stdout of that moment, which in a test process is a
# capture stream that is later closed. Every DEBUG record of jax (compiles,
# cache lookups) then goes through it for the rest of the worker's life, and
# a record logged from a driver thread whose error report also meets a
# closed stream raises out of logging. Put the root logger back.
for _h in set(logging.root.handlers) - set(_root_handlers):
  logging.root.removeHandler(_h)
logging.root.setLevel(_root_level)

BOS, EOS = 1, 2


def _adapter(model, sampling, seed=0):
  engine = RolloutEngine.for_model(model, num_slots=3, max_prompt_len=16, max_new_tokens=10,
                                   sampling=sampling, stop_token_ids=[EOS])
  return engine, JetStreamEngine(engine, model, tokenizer=IdTokenizer(bos_id=BOS, eos_id=EOS), seed=seed)


def test_adapter_is_a_jetstream_engine():
  _, js = _adapter(small_model(0), SamplingParams(0.0))
  assert isinstance(js, engine_api.Engine)
  assert js.max_concurrent_decodes == 3 and js.samples_per_slot == 1 and js.max_prefill_length == 16


def test_prefill_insert_generate_match_rollout_with_sampling():
  model = small_model(1)
  engine, js = _adapter(model, SamplingParams(temperature=1.5), seed=7)
  params = js.load_params()
  prompt = [BOS, 9, 33, 41, 5]
  padded = np.zeros(16, np.int32)
  padded[:5] = prompt
  state = js.insert(js.prefill(params=params, padded_tokens=padded, true_length=5),
                    js.init_decode_state(), slot=1)
  tokens = []
  for _ in range(10):
    state, result = js.generate(params, state)
    slot = result.convert_to_numpy().get_result_at_slot(1)
    if not slot.valid[0, 0]:
      break
    tokens.append(int(slot.tokens[0, 0]))
    assert slot.lengths[0] == len(tokens)
  # Request 0 of the adapter samples with fold_in(key(7), 0), like row 0 here.
  direct = engine.rollout(params, [prompt], key=jax.random.key(7))
  assert tokens == direct.row(0)


async def _decode_all(client, requests, max_tokens):
  async def one(tokens):
    req = jetstream_pb2.DecodeRequest(
        token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=tokens), max_tokens=max_tokens)
    out = []
    async for resp in client.Decode(req):
      out.extend(resp.stream_content.samples[0].token_ids)
    return out
  return await asyncio.gather(*(one(r) for r in requests))


@pytest.fixture
def driver_thread_errors(monkeypatch):
  """A driver thread that raises SIGKILLs its process (JetThread), which under
  pytest-xdist is a worker lost without a word; record the error instead."""
  errors = []

  def run(self):
    try:
      threading.Thread.run(self)
    except Exception:  # noqa: BLE001 - reported by the test
      errors.append(f"{self.name}: {traceback.format_exc()}")

  monkeypatch.setattr(orchestrator.JetThread, "run", run)
  return errors


def test_orchestrator_driver_returns_the_engines_tokens(driver_thread_errors):
  model = small_model(2)
  engine, js = _adapter(model, SamplingParams(temperature=0.0))
  params = js.load_params()
  # Compile the driver's programs here, once: the driver's threads would
  # each compile a program they first call together, and write the same
  # persistent-cache entry at once. A second adapter over the same engine
  # keeps `js`'s request numbering (its key schedule) at 0.
  warm = JetStreamEngine(engine, model, tokenizer=js.tokenizer)
  prefix = warm.prefill(params=params, padded_tokens=np.asarray([BOS, 3] + [0] * 14, np.int32), true_length=2)
  jax.block_until_ready(warm.generate(params, warm.insert(prefix, warm.init_decode_state(), slot=0)))
  driver = orchestrator.Driver(prefill_engines=[js], generate_engines=[js],
                               prefill_params=[params], generate_params=[params],
                               interleaved_mode=True)
  requests = [[3, 4, 5], [10, 20], [7, 7, 7, 7, 8], [30], [12, 13, 14, 15], [60, 1]]  # 6 > 3 slots

  async def decode_then_stop():
    try:
      return await asyncio.wait_for(_decode_all(orchestrator.LLMOrchestrator(driver=driver),
                                                requests, max_tokens=8), timeout=240)
    finally:
      # Stopped before asyncio.run closes the loop: a detokenize thread can
      # still be closing a request's channel, which schedules on the loop.
      driver.stop()

  try:
    got = asyncio.run(decode_then_stop())
  except TimeoutError:
    pytest.fail(driver_thread_errors[0] if driver_thread_errors else "no reply within 240 s")
  assert not driver_thread_errors, driver_thread_errors[0]
  # JetStream prepends BOS to token requests and leaves the stop token out.
  direct = engine.rollout(params, [[BOS] + r for r in requests], key=jax.random.key(0), max_new_tokens=8)
  for n, out in enumerate(got):
    expected = direct.row(n)
    if expected and expected[-1] == EOS:
      expected = expected[:-1]
    assert out == expected, f"request {n}"
  assert any(len(o) == 8 for o in got)
