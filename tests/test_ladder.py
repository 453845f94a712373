"""`jaxroll ladder`: rungs, interference pairs and their arithmetic, and a tiny ladder end to end."""

import json
import os

import pytest

from jaxroll import cli
from jaxroll import config as config_lib
from jaxroll import ladder as ladder_lib
from test_training import tiny


def test_rungs_add_one_component_each_in_order():
  r = ladder_lib.rungs(["async", "lpt", "greso", "vigor"])
  assert [label for label, _ in r] == ["grpo", "+async", "+lpt", "+greso", "+vigor"]
  assert r[0][1] == "grpo"
  assert r[1][1] == "grpo@pipeline.mode=async@pipeline.max_lag=1@rl.off_policy=tis"
  assert r[3][1] == "greso@pipeline.mode=async@pipeline.max_lag=1@rl.off_policy=tis@schedule.order=lpt"
  assert r[4][1].startswith("greso,vigor@")
  base = config_lib.ExperimentConfig()
  from jaxroll.compare import variant_config

  cfg = variant_config(base, r[4][1])
  assert (cfg.algorithm.techniques, cfg.pipeline.mode, cfg.schedule.order) == ("greso,vigor", "async", "lpt")


def test_the_kv_cache_components_are_valid_configs():
  from jaxroll.compare import variant_config

  base = config_lib.ExperimentConfig()
  paged = variant_config(base, ladder_lib.variant(["lpt", "paged"])).rollout
  assert (paged.kv_cache, paged.kv_sparsity) == ("paged", "none")
  cfg = variant_config(base, ladder_lib.variant(["async", "sparse"]))
  r = cfg.rollout
  assert (r.kv_cache, r.kv_sparsity, r.kv_budget, r.kv_budget_p5) == ("paged", "quest", 0.25, 0.86)
  assert (cfg.rl.off_policy, cfg.rl.mismatch_reject, cfg.pipeline.mode) == ("tis", 2.0, "async")


def test_unknown_components_and_malformed_pairs_fail_in_one_line(capsys):
  with pytest.raises(config_lib.ConfigError, match="'lpf' is unknown"):
    ladder_lib.rungs(["async", "lpf"])
  with pytest.raises(config_lib.ConfigError, match="expected A:B"):
    ladder_lib.parse_pairs("partial-async")
  assert cli.main(["ladder", "configs/quick.py", "--stack", "async,nope", "--target", "0.5",
                   "--out", "/nonexistent/ladder"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "'nope' is unknown" in err[0]


def _fake_train(costs, no_steady=()):
  """A train_fn writing a run whose accuracy reaches 1.0 at the second
  evaluation, after costs[component set] (seconds, tokens, rollouts), 20
  of the seconds compiling in its first step (with no_steady, a run logged
  before the compile clock was kept)."""

  def train(cfg, resume=False):
    key = (cfg.pipeline.mode, cfg.schedule.over_provision, cfg.algorithm.techniques)
    s, t, r = costs[key]
    os.makedirs(cfg.run_dir, exist_ok=True)
    with open(os.path.join(cfg.run_dir, "metrics.jsonl"), "w") as f:
      for step, acc, k in ((0, 0.0, 0), (cfg.steps // 2, 0.4, 0.5), (cfg.steps, 1.0, 1)):
        f.write(json.dumps({"step": step, "heldout_accuracy": acc, "cumulative_tokens": t * k,
                            "cumulative_rollouts": r * k}) + "\n")
    with open(os.path.join(cfg.run_dir, "timing.jsonl"), "w") as f:
      for step, k in ((0, 0), (cfg.steps // 2, 0.5), (cfg.steps, 1)):
        steady = {} if key in no_steady else {"cumulative_steady_s": s * k - 20 * (k > 0)}
        f.write(json.dumps({"step": step, "cumulative_train_s": s * k, **steady}) + "\n")

  return train


def test_ladder_ratios_and_interaction_by_hand(tmp_path):
  costs = {("sync", 1.0, ""): (100.0, 1000, 80), ("async", 1.0, ""): (60.0, 1000, 80),
           ("async", 1.0, "greso"): (45.0, 800, 60), ("sync", 1.25, ""): (80.0, 1000, 80),
           ("async", 1.25, ""): (56.0, 1000, 80)}
  base = tiny(str(tmp_path / "unused"), "steps=4", "warm_start.steps=0")
  out = str(tmp_path / "ladder")
  res = ladder_lib.ladder(base, ["async", "greso"], [0], 0.9, out, pairs=[("partial", "async")],
                          train_fn=_fake_train(costs))
  rungs = {r["rung"]: r for r in res["rungs"]}
  assert rungs["+async"]["cumulative_train_s"] == 60.0
  assert rungs["+async"]["cumulative_train_s_vs_previous"] == pytest.approx(100 / 60)
  assert rungs["+greso"]["cumulative_train_s_vs_previous"] == pytest.approx(60 / 45)
  assert rungs["+greso"]["cumulative_tokens_vs_grpo"] == pytest.approx(1000 / 800)
  assert rungs["+greso"]["cumulative_rollouts_vs_grpo"] == pytest.approx(80 / 60)
  # Net of the 20 s of compilation: GRPO 80 s, +async 40 s, +greso 25 s.
  assert rungs["+async"]["cumulative_steady_s_vs_grpo"] == pytest.approx(80 / 40)
  assert rungs["+greso"]["cumulative_steady_s_vs_previous"] == pytest.approx(40 / 25)
  (pair,) = res["pairs"]
  # c_partial = 0.8, c_async = 0.6, c_both = 0.56: interaction 0.56 / 0.48.
  assert pair["cumulative_train_s"]["ab"] == pytest.approx(0.56)
  assert pair["cumulative_train_s_interaction"] == pytest.approx(0.56 / (0.8 * 0.6))
  assert pair["cumulative_tokens_interaction"] == pytest.approx(1.0)
  md = open(os.path.join(out, "ladder.md")).read()
  assert "| +greso | 1/1 |" in md and "| partial x async | seconds | 0.80 | 0.60 | 0.56 | 1.17 |" in md
  # c = 60/80, 40/80 and 36/80: interaction 0.45 / 0.375.
  assert "| partial x async | seconds net of compilation | 0.75 | 0.50 | 0.45 | 1.20 |" in md
  assert "| +async | 1/1 | 1.000 | 60.0 | 40.0 |" in md


def test_a_run_logged_without_the_compile_clock_has_no_net_seconds(tmp_path):
  costs = {("sync", 1.0, ""): (100.0, 1000, 80), ("sync", 1.0, "greso"): (60.0, 800, 60)}
  base = tiny(str(tmp_path / "unused"), "steps=4", "warm_start.steps=0")
  out = str(tmp_path / "ladder")
  res = ladder_lib.ladder(base, ["greso"], [0], 0.9, out, pairs=[],
                          train_fn=_fake_train(costs, no_steady={("sync", 1.0, "greso")}))
  greso = res["rungs"][1]
  assert greso["cumulative_train_s_vs_grpo"] == pytest.approx(100 / 60)
  assert greso["cumulative_steady_s"] is None and greso["cumulative_steady_s_vs_grpo"] is None
  assert "| +greso | 1/1 | 1.000 | 60.0 | not logged |" in open(os.path.join(out, "ladder.md")).read()


def test_one_target_per_seed_gives_the_costs_of_that_target(tmp_path):
  # Seeds whose warm starts are too far apart get one Q* each
  # (compare.per_seed_targets); with one seed it is the single target's ladder.
  costs = {("sync", 1.0, ""): (100.0, 1000, 80), ("sync", 1.0, "greso"): (60.0, 800, 60)}
  base = tiny(str(tmp_path / "unused"), "steps=4", "warm_start.steps=0")
  one = ladder_lib.ladder(base, ["greso"], [0], 0.9, str(tmp_path / "one"), pairs=[], train_fn=_fake_train(costs))
  per = ladder_lib.ladder(base, ["greso"], [0], {0: 0.9}, str(tmp_path / "per"), pairs=[],
                          train_fn=_fake_train(costs))
  assert per["rungs"] == one["rungs"]
  assert "Q* = per seed (seed 0: 0.900)" in open(os.path.join(tmp_path, "per", "ladder.md")).read()


@pytest.mark.slow
def test_a_tiny_ladder_runs_end_to_end(tmp_path):
  base = tiny(str(tmp_path / "unused"), "steps=2", "eval_every=2", "tensorboard=false")
  out = str(tmp_path / "ladder")
  res = ladder_lib.ladder(base, ["lpt", "dapo"], [0], 0.0, out, pairs=[("greso", "lpt")])
  assert [r["rung"] for r in res["rungs"]] == ["grpo", "+lpt", "+dapo"]
  assert all(r["reached"] == 1 for r in res["rungs"])  # Q* = 0: reached at step 0
  for name in ("ladder.json", "ladder.md", "cost_rollouts.png"):
    assert os.path.isfile(os.path.join(out, name))
  # GRPO, the two rungs and the pair's three runs (lpt alone is a rung already).
  runs = [d for d in os.listdir(out) if os.path.isdir(os.path.join(out, d))]
  assert len(runs) == 5
