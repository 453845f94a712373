"""`jaxroll compare`: costs to Q* from run folders, ratios to the baseline and
to random controls, and a small comparison run end to end."""

import json
import os

import pytest

from jaxroll import compare as compare_lib
from test_training import tiny


def _fake_run(path, accs, rollouts, seconds):
  os.makedirs(path)
  steps = range(0, 10 * len(accs), 10)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for s, a, r in zip(steps, accs, rollouts):
      f.write(json.dumps({"step": s, "heldout_accuracy": a, "cumulative_rollouts": r,
                          "cumulative_tokens": 10 * r}) + "\n")
  with open(os.path.join(path, "timing.jsonl"), "w") as f:
    for s, t in zip(steps, seconds):
      f.write(json.dumps({"step": s, "cumulative_train_s": t}) + "\n")


def test_costs_to_target_and_ratios_by_hand(tmp_path):
  runs = {  # (variant, seed): accuracies at steps 0, 10, 20 and cumulative rollouts there
      ("grpo", 0): ([0.3, 0.6, 0.8], [0, 100, 200]), ("grpo", 1): ([0.3, 0.7, 0.9], [0, 100, 200]),
      ("greso", 0): ([0.3, 0.8, 0.9], [0, 80, 160]), ("greso", 1): ([0.3, 0.75, 0.9], [0, 60, 120]),
      ("random_greso", 0): ([0.3, 0.5, 0.8], [0, 80, 160]), ("random_greso", 1): ([0.3, 0.4, 0.6], [0, 80, 160]),
  }
  dirs = {}
  for (v, s), (accs, rolls) in runs.items():
    dirs[v, s] = str(tmp_path / v / f"seed{s}")
    _fake_run(dirs[v, s], accs, rolls, [0.0, 1.0, 2.0])
  summary = compare_lib.summarise(dirs, target=0.75)
  t = summary.table
  # grpo reaches 0.75 at 200 (seed 0) and 200 (seed 1): mean 200; greso at 80 and 60: mean 70.
  assert t["grpo"]["cumulative_rollouts"] == 200 and t["greso"]["cumulative_rollouts"] == 70
  assert t["greso"]["cumulative_rollouts_vs_grpo"] == pytest.approx(200 / 70)
  assert t["greso"]["cumulative_tokens"] == 700
  # The control's seed 1 never reaches 0.75: no mean, no ratio.
  assert t["random_greso"]["reached"] == 1 and t["random_greso"]["cumulative_rollouts"] is None
  assert t["greso"]["cumulative_rollouts_vs_control"] is None
  md = compare_lib.to_markdown(summary)
  assert "| greso | 2/2 |" in md and "2.86x" in md and "not reached" in md


def test_a_warm_start_the_base_config_names_is_every_runs(tmp_path):
  """With warm_start.from_dir set, no run warm-starts itself (there is no
  run_dir/warm_start for the others to load): every run loads the named one."""
  base = tiny(str(tmp_path / "unused"), "steps=2", f"warm_start.from_dir={tmp_path / 'policy'}")
  calls = []
  compare_lib.run_all(base, ["grpo", "greso"], [0, 1], str(tmp_path / "cmp"),
                      train_fn=lambda cfg, resume: calls.append(cfg))
  assert len(calls) == 4
  assert {c.warm_start.from_dir for c in calls} == {str(tmp_path / "policy")}
  # Without one, the baseline of each seed warm-starts and the others load its policy.
  calls.clear()
  compare_lib.run_all(tiny(str(tmp_path / "unused")), ["grpo", "greso"], [0], str(tmp_path / "cmp2"),
                      train_fn=lambda cfg, resume: calls.append(cfg))
  assert [c.warm_start.from_dir for c in calls] == ["", os.path.join(str(tmp_path / "cmp2"), "grpo", "seed0", "warm_start")]


@pytest.mark.slow
def test_compare_runs_variants_over_seeds_with_a_shared_warm_start(tmp_path):
  base = tiny(str(tmp_path / "unused"), "steps=2", "eval_every=2", "rl.minibatches=1",
              "rl.kl_coef=0", "tensorboard=false")
  out = str(tmp_path / "cmp")
  summary = compare_lib.compare(base, ["grpo", "greso", "random_greso"], [0, 1], target=0.0, out_dir=out)
  assert set(summary.table) == {"grpo", "greso", "random_greso"}
  for name in ("compare.json", "compare.md", "cost_rollouts.png", "cost_generated_tokens.png"):
    assert os.path.isfile(os.path.join(out, name)), name
  for seed in (0, 1):
    first = [json.loads(x) for x in open(os.path.join(out, "grpo", f"seed{seed}", "metrics.jsonl"))][0]
    for v in ("greso", "random_greso"):
      run = os.path.join(out, v, f"seed{seed}")
      # The warm-started policy is shared: same step-0 evaluation, no warm-start phase.
      assert [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))][0] == first
      assert not os.path.exists(os.path.join(run, "warm_start.jsonl"))
  # Finished runs are reused: a second call trains nothing.
  calls = []
  compare_lib.compare(base, ["grpo", "greso", "random_greso"], [0, 1], target=0.0, out_dir=out,
                      train_fn=lambda cfg, resume: calls.append(cfg))
  assert calls == []
  # ... but only when they ran the asked-for config. A finished run at
  # another setting (here greso's, as if run at eval_every=1) is refused by
  # name before anything trains (dapo has not run yet); how runs report
  # (progress) does not make a different run.
  greso_cfg = os.path.join(out, "greso", "seed0", "config.json")
  saved = json.load(open(greso_cfg))
  json.dump({**saved, "eval_every": 1}, open(greso_cfg, "w"))
  with pytest.raises(compare_lib.config_lib.ConfigError, match=r"greso/seed0 .*eval_every: that run 1, asked for 2"):
    compare_lib.compare(base, ["grpo", "dapo", "greso"], [0], target=0.0, out_dir=out,
                        train_fn=lambda cfg, resume: calls.append(cfg))
  assert calls == []
  json.dump(saved, open(greso_cfg, "w"))
  quiet = compare_lib.config_lib.apply_overrides(base, ["progress=false"])
  compare_lib.compare(quiet, ["grpo", "greso"], [0], target=0.0, out_dir=out,
                      train_fn=lambda cfg, resume: calls.append(cfg))
  assert calls == []


def test_variant_overrides_and_their_random_control(tmp_path):
  base = tiny(str(tmp_path / "unused"))
  cfg = compare_lib.variant_config(base, "vigor@algorithm.budget=24@rollout.group_size=3", seed=4)
  assert (cfg.algorithm.techniques, cfg.algorithm.budget, cfg.rollout.group_size, cfg.seed) == ("vigor", 24, 3, 4)
  assert compare_lib.variant_config(base, "grpo@rollout.group_size=2").algorithm.techniques == ""
  with pytest.raises(compare_lib.config_lib.ConfigError, match="not KEY=VALUE"):
    compare_lib.variant_config(base, "greso@budget")
  with pytest.raises(compare_lib.config_lib.ConfigError, match="budget"):
    compare_lib.variant_config(base, "vigor@algorithm.budget=-1")
  dirs = {}
  for v, accs in (("grpo", [0.3, 0.5, 0.8]), ("greso@task.num_train=64", [0.3, 0.8, 0.9]),
                  ("random_greso@task.num_train=64", [0.3, 0.5, 0.8])):
    dirs[v, 0] = str(tmp_path / v / "seed0")
    _fake_run(dirs[v, 0], accs, [0, 100, 200], [0.0, 1.0, 2.0])
  t = compare_lib.summarise(dirs, target=0.75).table
  assert t["greso@task.num_train=64"]["cumulative_rollouts_vs_control"] == pytest.approx(2.0)


def test_baseline_targets_lie_in_the_range_every_grpo_seed_traverses(tmp_path):
  dirs = {}
  for (v, s), accs in {("grpo", 0): [0.3, 0.5, 0.7], ("grpo", 1): [0.2, 0.6, 0.5],
                       ("greso", 0): [0.4, 0.9, 0.95]}.items():
    dirs[v, s] = str(tmp_path / v / f"seed{s}")
    _fake_run(dirs[v, s], accs, [0, 10, 20], [0.0, 1.0, 2.0])
  # From the best warm start (0.3) to the lowest best (0.6); greso's runs do not count.
  assert compare_lib.baseline_targets(dirs, [0.5, 0.9]) == [0.45, 0.57]
  with pytest.raises(ValueError, match="no 'grpo' runs"):
    compare_lib.baseline_targets({k: d for k, d in dirs.items() if k[0] != "grpo"}, [0.5])
  flat = {("grpo", 0): str(tmp_path / "flat")}
  _fake_run(flat["grpo", 0], [0.5, 0.4, 0.5], [0, 10, 20], [0.0, 1.0, 2.0])
  with pytest.raises(ValueError, match="does not improve"):
    compare_lib.baseline_targets(flat, [0.5])


def test_per_seed_targets_measure_each_seed_against_its_own_grpo_run(tmp_path):
  """Warm starts 0.6 and 0.1 with bests 0.8 and 0.3: no common target lies in
  both ranges, so each seed gets its own, halfway across its GRPO range."""
  dirs = {}
  for (v, s), accs in {("grpo", 0): [0.6, 0.7, 0.8], ("grpo", 1): [0.1, 0.3, 0.2],
                       ("greso", 0): [0.6, 0.8, 0.8], ("greso", 1): [0.1, 0.1, 0.25]}.items():
    dirs[v, s] = str(tmp_path / v / f"seed{s}")
    _fake_run(dirs[v, s], accs, [0, 10, 20], [0.0, 1.0, 2.0])
  with pytest.raises(ValueError, match="does not improve"):
    compare_lib.baseline_targets(dirs, [0.5])
  targets = compare_lib.per_seed_targets(dirs, 0.5)
  assert targets == {0: 0.7, 1: 0.2}
  s = compare_lib.summarise(dirs, targets)
  # grpo: 10 rollouts on both seeds; greso: 10 on seed 0, 20 on seed 1 (0.25 >= 0.2 at its third eval).
  assert s.per_run["greso/seed0"]["cumulative_rollouts"] == 10
  assert s.per_run["greso/seed1"]["cumulative_rollouts"] == 20
  assert s.table["greso"]["cumulative_rollouts_vs_grpo"] == pytest.approx(10 / 15)
  assert "seed 0: 0.700, seed 1: 0.200" in compare_lib.to_markdown(s)
  flat = {("grpo", 0): str(tmp_path / "flat")}
  _fake_run(flat["grpo", 0], [0.5, 0.4, 0.5], [0, 10, 20], [0.0, 1.0, 2.0])
  with pytest.raises(ValueError, match="seed 0 does not improve"):
    compare_lib.per_seed_targets(flat, 0.5)
