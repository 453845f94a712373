"""What every run of the loop must satisfy, checked from its run folder.

  lag:       every batch trails its update by at most pipeline.max_lag versions;
  age:       no token in the loss is more than max(schedule.max_age,
             pipeline.max_lag) versions older than the update that uses it
             (carried rows past max_age restart; fresh tokens trail by the lag);
  groups:    every launched group was handed over (to the update, or
             selected out) or is still in flight at the end;
  rollouts:  every row a plan asked for (launch or extension) finished or is
             still in flight at the end: the rollouts spent are the plan's;
  batches:   one record per step, steps 1..N in order (none lost or repeated).

The accounting counters are summed over processes (jaxroll.loop.step_metrics).

`violations(run_dir)` returns one line per broken rule (empty: all hold).
"""

from __future__ import annotations

import json
import os

from jaxroll.metrics.logger import read_jsonl


def violations(run_dir: str) -> list[str]:
  with open(os.path.join(run_dir, "config.json")) as f:
    cfg = json.load(f)
  steps = [m for m in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if m["step"] > 0]
  out = []
  if [m["step"] for m in steps] != list(range(1, len(steps) + 1)):
    out.append(f"batches: steps {[m['step'] for m in steps]} are not 1..{len(steps)}")
  if not steps:
    return out
  max_lag, max_age = cfg["pipeline"]["max_lag"], cfg["schedule"]["max_age"]
  for m in steps:
    if not 0 <= m["policy_lag"] <= max_lag:
      out.append(f"lag: step {m['step']} used a batch {m['policy_lag']} versions old (max_lag={max_lag})")
    if m["token_age_max"] > max(max_age, max_lag):
      out.append(f"age: step {m['step']} trained on a token {m['token_age_max']} versions old "
                 f"(max_age={max_age}, max_lag={max_lag})")
  last = steps[-1]
  launched = sum(m["groups_launched"] for m in steps)
  handed = sum(m["groups_handed_over"] for m in steps)
  if launched != handed + last["groups_in_flight"]:
    out.append(f"groups: {launched} launched, {handed} handed over + {last['groups_in_flight']} in flight")
  planned = sum(m["rows_planned"] for m in steps)
  finished = sum(m["rollouts_generated"] for m in steps)
  if planned != finished + last["rows_in_flight"]:
    out.append(f"rollouts: {planned} rows planned, {finished} finished + {last['rows_in_flight']} in flight")
  return out
