"""The rollout thread against randomised phase timings: lag bound, order,
crash propagation and shutdown."""

import random
import time

import pytest

from jaxroll.pipeline.producer import RolloutProducer, RolloutThreadError
from jaxroll.pipeline.weights import WeightStore


def _run(max_lag, steps, seed, fail_at=None):
  """Trainer loop with random update times against a sampler with random
  rollout times. Returns [(step, version the batch started with)]."""
  rng = random.Random(seed)
  sample_times = [rng.choice([0.0, 0.001, 0.004]) for _ in range(steps)]
  update_times = [rng.choice([0.0, 0.001, 0.004]) for _ in range(steps)]
  store = WeightStore(params="v0", version=0)

  def sample(params, step, version):
    assert params == f"v{version}"
    if step == fail_at:
      raise ZeroDivisionError("boom in rollout")
    time.sleep(sample_times[step])
    return step

  producer = RolloutProducer(sample, store, start=0, end=steps, max_lag=max_lag).start()
  seen = []
  try:
    for u in range(steps):
      batch = producer.get()
      assert batch.sample == batch.step == u  # step order
      seen.append((u, batch.version))
      time.sleep(update_times[u])
      store.publish(f"v{u + 1}", u + 1)
  finally:
    producer.close()
  assert not producer.thread.is_alive()
  return seen


@pytest.mark.parametrize("max_lag", [0, 1, 2, 4])
def test_no_batch_trails_its_update_by_more_than_k_versions(max_lag):
  lags = []
  for seed in range(8):
    seen = _run(max_lag, steps=25, seed=seed)
    assert [u for u, _ in seen] == list(range(25))
    lags += [u - v for u, v in seen]
  assert min(lags) >= 0 and max(lags) <= max_lag
  if max_lag:
    assert max(lags) >= 1  # the sampler does run ahead when it may


def test_a_crash_in_the_rollout_thread_reaches_the_trainer_with_its_traceback():
  with pytest.raises(RolloutThreadError) as info:
    _run(max_lag=2, steps=10, seed=0, fail_at=4)
  assert isinstance(info.value.__cause__, ZeroDivisionError)
  assert "boom in rollout" in str(info.value.__cause__)
  assert info.value.__cause__.__traceback__ is not None


def test_close_stops_a_sampler_waiting_for_weights_or_queue_space():
  store = WeightStore(params=None, version=0)
  producer = RolloutProducer(lambda p, u, v: u, store, start=0, end=100, max_lag=1).start()
  time.sleep(0.05)  # it has filled the queue and waits for weights
  t0 = time.perf_counter()
  producer.close()
  assert not producer.thread.is_alive() and time.perf_counter() - t0 < 5
  with pytest.raises(ValueError, match="not newer"):
    store.publish(None, 0)


def test_layout_projection_by_hand(tmp_path):
  import json

  from jaxroll.pipeline.project import project_layouts

  (tmp_path / "config.json").write_text(json.dumps({"rollout": {"num_slots": 2}}))
  steps = range(4)
  with open(tmp_path / "metrics.jsonl", "w") as f:
    for s in steps:
      f.write(json.dumps({"step": s, "rollout_makespan_steps": 4}) + "\n")
  with open(tmp_path / "timing.jsonl", "w") as f:
    for s in steps:  # the first record includes compilation and is skipped
      f.write(json.dumps({"step": s, "rollout_s": 9.0 if s == 0 else 0.4, "update_s": 0.3}) + "\n")
  with open(tmp_path / "lengths.jsonl", "w") as f:
    for s in steps:
      f.write(json.dumps({"step": s, "lengths": [4, 2, 2]}) + "\n")
  p = project_layouts(str(tmp_path), devices=2, scale=1)
  # 0.1 s per decode step; makespan 4 on 2 or 4 slots; update 0.3 s on one device.
  assert p["t_decode_s"] == pytest.approx(0.1) and p["update_s"] == pytest.approx(0.3)
  assert p["colocated_sync_s"] == pytest.approx(0.4 + 0.15)
  assert p["disaggregated_sync_s"] == pytest.approx(0.4 + 0.3)
  assert p["disaggregated_async_s"] == pytest.approx(0.4)
  assert p["async_vs_colocated"] == pytest.approx(0.55 / 0.4)
