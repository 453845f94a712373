"""Training with a paged KV cache: the same run as dense, less KV; sparse pages measured."""

import json
import os

import pytest

from jaxroll.config import ConfigError
from test_training import tiny, train_once

# A pool of 24 one-position pages, where the 16 slots at full length would
# take 320: rows wait for pages, and some are preempted and resumed.
PAGED = ["rollout.kv_cache=paged", "rollout.kv_page_size=1", "rollout.kv_pages=24", "steps=4"]
# With fewer pages than slots rows wait, so the schedule differs (not the tokens).
VOLATILE = {"kv_peak_bytes", "kv_preemptions", "rollout_makespan_steps", "slot_idle_fraction"}


def _steps(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f][1:]


def test_paged_training_equals_dense_with_less_kv(tmp_path_factory):
  dense = _steps(train_once(tmp_path_factory, "dense", "steps=4"))
  paged = _steps(train_once(tmp_path_factory, "paged", *PAGED))
  assert len(dense) == len(paged) == 4
  for d, p in zip(dense, paged):
    keys = {k for k in d if k not in VOLATILE and not k.endswith("_s")}
    assert keys == {k for k in p if k not in VOLATILE and not k.endswith("_s")}
    # Same tokens, so the same counts and rewards; log-probs agree to float
    # rounding (the paged attention sums in another order), and the update's
    # statistics built on them (importance-weight extremes included) nearly.
    differ = [k for k in keys if (p[k] != pytest.approx(d[k], rel=1e-2, abs=1e-3)
                                  if isinstance(d[k], float) else p[k] != d[k])]
    assert not differ, {k: (d[k], p[k]) for k in differ}
    assert p["kv_peak_bytes"] < d["kv_peak_bytes"]
  assert sum(p["kv_preemptions"] for p in paged) > 0


def test_sparse_rollout_trains_and_its_mismatch_is_measured(tmp_path_factory):
  """Sampling with a quarter of the pages: the sampler is an approximation of
  the policy, the per-step mismatch shows it, and rows past the rejection
  threshold leave the loss."""
  sparse = _steps(train_once(tmp_path_factory, "sparse", "rollout.kv_cache=paged", "steps=3",
                             "rollout.kv_page_size=1", "rollout.kv_sparsity=quest",
                             "rollout.kv_budget=0.25", "rl.off_policy=tis", "rl.mismatch_reject=0.01"))
  for m in sparse:
    assert m["mismatch_abs_mean"] > 1e-4 and m["mismatch_agreement_p5"] < 1.0
    assert 0 < m["mismatch_rejected_rows"] <= 16


@pytest.mark.parametrize("overrides,needle", [
    (["rollout.kv_sparsity=quest"], "set rollout.kv_cache=paged"),
    (["rollout.kv_cache=paged", "rollout.kv_pages=1"], "cannot hold one full row"),
    (["rollout.kv_cache=paged", "rollout.kv_budget=0"], "kv_budget"),
    (["rollout.kv_cache=paged", "mesh.fsdp=2"], "not yet sharded"),
    (["rollout.kv_cache=blocks"], "rollout.kv_cache"),
])
def test_bad_kv_cache_settings_fail_before_any_work(overrides, needle, tmp_path):
  with pytest.raises(ConfigError, match=needle):
    tiny(str(tmp_path / "run"), *overrides)
