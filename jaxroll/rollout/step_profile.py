"""Where a compiled program's time goes, by the jaxroll function that emitted each op.

jax's profiler records one event per executed XLA:CPU thunk (a fusion, a
library matmul, a copy), named after the HLO instruction. The optimised
HLO text carries, for every instruction, the Python stack that traced it
(its `stack_frame_id` and the FileNames / FunctionNames / FileLocations /
StackFrames tables at the top of the module). Joining the two gives each
function's inclusive time: every thunk's duration is added once to each
function on its stack. Control-flow thunks (while loops, conditionals,
calls) are skipped, since the thunks they run are counted themselves.

This is how the row-bucket hoisting in jaxroll.rollout.live_forward was
found: the first layer's matmuls of every bucket carried the decode
step's stack, not the bucket's.

Both formats are jax's and XLA's own and not a stable API: `profile` raises
RuntimeError with what it could not read rather than returning a wrong
split. CPU only (a GPU trace names kernels, not thunks).
"""

from __future__ import annotations

import glob
import gzip
import json
import re
import tempfile
from collections import defaultdict
from typing import Callable

import jax

_CONTROL = ("while", "cond", "conditional", "call")


def _table(hlo: str, name: str) -> list[str]:
  head = "\n" + name + "\n"
  if head not in hlo:
    raise RuntimeError(f"the optimised HLO has no {name} table (this jax prints no stack frames)")
  return hlo.split(head, 1)[1].split("\n\n", 1)[0].splitlines()


def stack_frames(hlo: str) -> Callable[[int], list[str]]:
  """`frames(stack_frame_id)` -> ["file.py:function", ...], innermost first."""
  entry = lambda line: (int(line.split()[0]), line.split(None, 1)[1].strip('"'))
  files = dict(entry(line) for line in _table(hlo, "FileNames"))
  funcs = dict(entry(line) for line in _table(hlo, "FunctionNames"))
  locations, frames = {}, {}
  for line in _table(hlo, "FileLocations"):
    m = re.match(r"(\d+) \{file_name_id=(\d+) function_name_id=(\d+)", line)
    locations[int(m.group(1))] = f"{files[int(m.group(2))].rsplit('/', 1)[-1]}:{funcs[int(m.group(3))]}"
  for line in _table(hlo, "StackFrames"):
    m = re.match(r"(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", line)
    # Parents are printed one above their id; 0 is the root's (none).
    frames[int(m.group(1))] = (int(m.group(2)), int(m.group(3)) - 1)

  def chain(frame_id: int) -> list[str]:
    out = []
    while frame_id in frames and len(out) < 100:
      location, parent = frames[frame_id]
      out.append(locations[location])
      if parent <= 0 or parent == frame_id:
        break
      frame_id = parent
    return out
  return chain


def instruction_frames(hlo: str) -> dict[str, int]:
  """HLO instruction name -> its stack_frame_id."""
  return {m.group(1): int(m.group(2))
          for m in re.finditer(r"^\s*%(\S+) = .*?stack_frame_id=(\d+)", hlo, re.M)}


def inclusive_times(hlo: str, events: list[dict]) -> tuple[dict[str, float], float]:
  """({"file.py:function": microseconds}, total leaf microseconds) over the
  trace's complete events that name an instruction of `hlo`."""
  chain, frame_of = stack_frames(hlo), instruction_frames(hlo)
  times: dict[str, float] = defaultdict(float)
  total = 0.0
  for e in events:
    name = e.get("name", "")
    if e.get("ph") != "X" or name not in frame_of or name.startswith(_CONTROL):
      continue
    total += e.get("dur", 0.0)
    for fn in dict.fromkeys(chain(frame_of[name])):  # once per function, recursion too
      times[fn] += e.get("dur", 0.0)
  return dict(times), total


def profile(jitted, args: tuple, run: Callable[[], object], units: int) -> dict:
  """Profiles `run()`, which executes `jitted(*args)`'s program and nothing
  else (two programs' instructions can share a name), and splits its thunk
  time by function.

  Returns {"total_us": leaf thunk microseconds per unit, "functions":
  [(name, microseconds per unit, share of the total)], largest first};
  `units` divides the totals (decode steps, tokens).
  """
  if jax.default_backend() != "cpu":
    raise RuntimeError(f"step profiles read XLA:CPU thunk events; this backend is {jax.default_backend()}")
  hlo = jitted.lower(*args).compile().as_text()
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d, create_perfetto_trace=True)
    try:
      run()
    finally:
      jax.profiler.stop_trace()
    traces = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)
    if not traces:
      raise RuntimeError("the profiler wrote no perfetto trace")
    with gzip.open(traces[0]) as f:
      events = json.load(f)["traceEvents"]
  times, total = inclusive_times(hlo, events)
  if not total:
    raise RuntimeError("no trace event named an instruction of the compiled program")
  ranked = sorted(times.items(), key=lambda kv: -kv[1])
  return {"total_us": total / units,
          "functions": [(name, t / units, t / total) for name, t in ranked]}
