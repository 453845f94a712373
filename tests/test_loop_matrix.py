"""Every pipeline, schedule and algorithm value runs in the one loop and keeps
the loop's invariants, and every synchronous run resumes byte for byte
(`scripts/loop_matrix.py --pairwise` runs every pair of values, without
flags the full product)."""

import importlib.util
import json
import os

import pytest

from jaxroll.loop.invariants import violations

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("loop_matrix", os.path.join(ROOT, "scripts", "loop_matrix.py"))
loop_matrix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(loop_matrix)


def test_pairwise_subset_covers_every_pair_of_values():
  combos = loop_matrix.combinations(pairwise=True)
  assert len(combos) == len(set(combos)) == 30
  names = (loop_matrix.PIPELINES, loop_matrix.SCHEDULES, loop_matrix.ALGORITHMS)
  for i, j in ((0, 1), (0, 2), (1, 2)):
    pairs = {(c[i], c[j]) for c in combos}
    assert pairs == {(x, y) for x in names[i] for y in names[j]}
  assert len(loop_matrix.combinations(pairwise=False)) == 90
  once = loop_matrix.combinations(pairwise=False, each_once=True)
  for i, values in enumerate(names):
    assert {c[i] for c in once} == set(values)
  assert len(once) == max(map(len, names)) and any(c[0] == "sync" for c in once)


@pytest.mark.slow
def test_every_loop_component_runs_and_keeps_the_invariants(tmp_path):
  results = loop_matrix.run_matrix(loop_matrix.combinations(pairwise=False, each_once=True), 4,
                                   str(tmp_path), resume="sync")
  broken = {" x ".join(c): v for c, v in results.items() if v}
  assert not broken, broken


def _run_folder(tmp_path, metrics, steps=2, max_lag=1, max_age=4):
  d = tmp_path / "run"
  d.mkdir(parents=True)
  (d / "config.json").write_text(json.dumps({"steps": steps, "pipeline": {"max_lag": max_lag},
                                             "schedule": {"max_age": max_age}}))
  (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
  return str(d)


def _step(step, **kw):
  m = dict(step=step, policy_lag=1, token_age_max=1, groups_launched=5, groups_handed_over=4,
           groups_in_flight=1, rows_planned=20, rollouts_generated=20, rows_in_flight=0)
  m.update(kw)
  return m


def test_invariants_hold_on_consistent_records_and_name_each_broken_rule(tmp_path):
  # Step 1 launches 5 groups and hands over 4; step 2 launches 4 and hands
  # over 4: one group and its 3 unfinished rows are in flight at the end.
  ok = [{"step": 0}, _step(1), _step(2, groups_launched=4, rows_planned=16, rollouts_generated=13,
                                     rows_in_flight=3)]
  assert violations(_run_folder(tmp_path / "a", ok)) == []
  for change, rule in ((dict(policy_lag=2), "lag:"), (dict(token_age_max=5), "age:"),
                       (dict(groups_handed_over=3), "groups:"), (dict(rollouts_generated=12), "rollouts:")):
    bad = ok[:2] + [{**ok[2], **change}]
    found = violations(_run_folder(tmp_path / rule[:-1], bad))
    assert len(found) == 1 and found[0].startswith(rule), found
  for name, records in (("lost", [ok[0], ok[2]]), ("repeated", ok[:2] + ok[1:])):
    assert violations(_run_folder(tmp_path / name, records))[0].startswith("batches:"), name
