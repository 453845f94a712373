"""Makespan simulation, LPT against the exact optimum, and the length predictor."""

import itertools
import json

import numpy as np
import pytest
from scipy import stats

from jaxroll.scheduling.length_predictor import HistoryLengthPredictor, prediction_error
from jaxroll.scheduling.makespan import list_schedule, order_for, partial_rollout_steps
from jaxroll.scheduling.simulate import simulate_run


def optimal_makespan(lengths, workers):
  """Brute force over every assignment of requests to workers."""
  best = float("inf")
  for assign in itertools.product(range(workers), repeat=len(lengths)):
    loads = np.zeros(workers)
    np.add.at(loads, list(assign), lengths)
    best = min(best, loads.max())
  return best


def test_hand_computed_makespans():
  # Graham's tight example: LPT gives 7 where the optimum {3,3} | {2,2,2} is 6.
  s = list_schedule([3, 3, 2, 2, 2], workers=2)
  assert s.makespan == 7 and s.idle_fraction == pytest.approx(1 - 12 / 14)
  assert optimal_makespan([3, 3, 2, 2, 2], 2) == 6
  # FIFO with the long request last: 1 | 1, then 1 -> 2 and 5 lands on the worker free at 1.
  assert list_schedule([1, 1, 1, 5], workers=2).makespan == 6
  assert list_schedule([1, 1, 1, 5], 2, order_for("lpt", [1, 1, 1, 5])).makespan == 5
  assert list_schedule([4, 2], workers=2, cost_per_token=0.5).makespan == 2
  assert list_schedule([], workers=3).makespan == 0


def test_lpt_stays_within_grahams_bound_of_the_optimum():
  rng = np.random.default_rng(0)
  worst = 0.0
  for _ in range(150):
    m = int(rng.integers(2, 4))
    lengths = rng.integers(1, 20, size=int(rng.integers(m + 1, 8))).tolist()
    lpt = list_schedule(lengths, m, order_for("lpt", lengths)).makespan
    opt = optimal_makespan(lengths, m)
    assert lpt <= (4 / 3 - 1 / (3 * m)) * opt + 1e-9
    worst = max(worst, lpt / opt)
  assert worst > 1.0  # the instances do exercise suboptimal schedules


def test_orders_and_bad_input():
  assert order_for("lpt_predicted", [1, 2, 3], predicted=[3, 1, 2]) == [0, 2, 1]
  assert sorted(order_for("random", list(range(6)), seed=1)) == list(range(6))
  with pytest.raises(ValueError, match="unknown order"):
    order_for("sjf", [1])
  with pytest.raises(ValueError, match="workers must be >= 1"):
    list_schedule([1], 0)


def test_history_predictor_and_its_error():
  p = HistoryLengthPredictor(window=2, default=7.0)
  assert p.predict([1, 2]).tolist() == [7.0, 7.0]
  p.observe([1, 1, 1, 2], [10, 20, 30, 4])
  assert p.predict([1, 2, 3]).tolist() == [25.0, 4.0, 16.0]  # window 2; unseen: global mean
  pred, real = [1.0, 2.0, 3.0, 4.0, 4.0], [2.0, 1.0, 4.0, 3.0, 5.0]
  err = prediction_error(pred, real)
  assert err["mae"] == pytest.approx(np.mean(np.abs(np.subtract(pred, real))))
  assert err["spearman"] == pytest.approx(stats.spearmanr(pred, real).statistic)
  assert np.isnan(prediction_error([1, 1], [1, 2])["spearman"])


def test_simulate_run_from_a_trace(tmp_path):
  trace = [{"step": 1, "prompt_ids": [0, 0, 1, 1], "lengths": [1, 1, 1, 5]},
           {"step": 2, "prompt_ids": [1, 1, 0, 0], "lengths": [5, 6, 1, 2]}]
  (tmp_path / "lengths.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trace))
  r = simulate_run(str(tmp_path), workers=2, group_size=2)
  # Step 1: FIFO 1 | 1, 1 -> 2, 5 -> 6; LPT 5. Step 2: FIFO 5 | 6, 1 -> 6, 2 -> 8; LPT 6 | 5, 2, 1 -> 7.
  assert r["orders"]["fifo"]["mean_makespan"] == (6 + 8) / 2
  assert r["orders"]["lpt"]["mean_makespan"] == (5 + 7) / 2
  assert r["orders"]["lpt"]["speedup_vs_fifo"] == pytest.approx(14 / 12)
  # Step 2 predictions from step 1's history: prompt 1 -> 3, prompt 0 -> 1 (same order as FIFO).
  assert r["orders"]["lpt_predicted"]["mean_makespan"] == (6 + 8) / 2
  assert r["predictor_mae"] == pytest.approx((2 + 3 + 0 + 1) / 4)
  assert r["predictor_spearman"] == pytest.approx(stats.spearmanr([3, 3, 1, 1], [5, 6, 1, 2]).statistic)
  assert r["length_mean"] == pytest.approx(22 / 8)
  # Both steps merged into one batch of 8 requests.
  merged = simulate_run(str(tmp_path), workers=2, group_size=2, steps_per_batch=2)
  assert merged["orders"]["fifo"]["batches"] == 1
  assert merged["orders"]["lpt"]["mean_makespan"] == 11  # 22 tokens on 2 workers: the optimum


def test_partial_rollout_steps_hand_computed():
  """P=1 group per update, 2 workers, 2 groups in flight (f=2), LPT.

  Step 1: g0=[4,1], g1=[1,1]: 4 | 1,1,1 -> g1 done at 3; g0's long row ran 3, 1 left.
  Step 2: g0=[1,-], g2=[3,3]: 3 | 3 -> g2 done at 3; g0's row never started.
  Step 3: g0=[1,-], g3=[1,1]: 1 | 1,1 -> g0 done at 1; g3 has one row left.
  Step 4: g3 alone: 1 token on one of two workers (half idle). Then the stream is empty.
  """
  steps = partial_rollout_steps([[4, 1], [1, 1], [3, 3], [1, 1]], per_step=1, workers=2,
                                over_provision=2.0)
  assert [s.makespan for s in steps] == [3, 3, 1, 1]
  assert [s.idle_fraction for s in steps] == [0, 0, 0, 0.5]
  # Without over-provisioning nothing is carried: each group runs to its end.
  assert [s.makespan for s in partial_rollout_steps([[4, 1], [1, 1]], 1, 2, 1.0)] == [4, 1]
  with pytest.raises(ValueError, match="over_provision"):
    partial_rollout_steps([[1, 1]], 1, 2, 0.5)


def test_simulate_cli_prints_one_table_per_worker_count(tmp_path):
  import os
  import subprocess
  import sys

  trace = [{"step": s, "prompt_ids": [0, 1, 2], "lengths": [3, 9, 4]} for s in (1, 2)]
  (tmp_path / "lengths.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trace))
  (tmp_path / "config.json").write_text(json.dumps({"rollout": {"group_size": 1}}))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-m", "jaxroll.cli", "simulate", str(tmp_path), "--workers", "1",
                        "--workers", "3"], cwd=root, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.count("| fifo |") == 2
  # 1 worker: 16 tokens per step, never idle. 3 workers: the 9-token request sets the
  # makespan, and 1 - 16 / 27 of the worker time is idle.
  assert "on 1 workers" in out.stdout and "| fifo | 2 | 16.0 | 16 | 0.000 | 1.00x |" in out.stdout
  assert "| lpt | 2 | 9.0 | 9 | 0.407 | 1.00x |" in out.stdout
