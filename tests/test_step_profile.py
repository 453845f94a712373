"""A decode step's time by jaxroll function: thunk events joined with the HLO's stack
frames (jaxroll/rollout/step_profile.py)."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxroll.model import Transformer
from jaxroll.rollout import RolloutEngine
from jaxroll.rollout.step_profile import inclusive_times, profile
from small_models import small_config

# Three functions: main -> step -> attend, and main -> step -> step (a
# recursion); frames as XLA prints them (a parent one above its id).
_HLO = """HloModule m

FileNames
1 "/src/run.py"
2 "/src/model.py"

FunctionNames
1 "main"
2 "step"
3 "attend"

FileLocations
1 {file_name_id=1 function_name_id=1 line=1 end_line=1 column=0 end_column=1}
2 {file_name_id=2 function_name_id=2 line=2 end_line=2 column=0 end_column=1}
3 {file_name_id=2 function_name_id=3 line=3 end_line=3 column=0 end_column=1}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=3}
4 {file_location_id=2 parent_frame_id=3}

ENTRY %e {
  %fusion.1 = f32[2] fusion(%p), kind=kLoop, metadata={op_name="a" stack_frame_id=3}
  %dot.2 = f32[2] dot(%p, %q), metadata={op_name="b" stack_frame_id=2}
  %copy.3 = f32[2] copy(%p), metadata={op_name="c" stack_frame_id=4}
  %while.4 = f32[2] while(%p), metadata={op_name="d" stack_frame_id=2}
}
"""


def test_each_thunk_counts_once_for_every_function_on_its_stack():
  events = [{"ph": "X", "name": "fusion.1", "dur": 10.0},  # main > step > attend
            {"ph": "X", "name": "dot.2", "dur": 5.0},  # main > step
            {"ph": "X", "name": "copy.3", "dur": 2.0},  # main > step > step: step once
            {"ph": "X", "name": "while.4", "dur": 100.0},  # control flow: its thunks count
            {"ph": "X", "name": "fusion.1", "dur": 1.0},
            {"ph": "i", "name": "dot.2", "dur": 50.0},  # not a complete event
            {"ph": "X", "name": "elsewhere", "dur": 7.0}]  # another program's
  times, total = inclusive_times(_HLO, events)
  assert total == 18.0
  assert times == {"run.py:main": 18.0, "model.py:step": 18.0, "model.py:attend": 11.0}


def test_a_module_without_stack_frames_is_refused():
  with pytest.raises(RuntimeError, match="no FileNames table"):
    inclusive_times("HloModule m\n\nENTRY %e {\n}\n", [])


def test_a_decode_step_splits_into_the_models_own_functions():
  """On a real decode loop: nearly every thunk sits under the engine's
  generate, the model's blocks hold its attention and MLP (so the stack
  parents are read the right way round), and no function exceeds its
  caller."""
  cfg = small_config()
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  B, N = 4, 6
  engine = RolloutEngine.for_model(model, num_slots=B, max_prompt_len=8, max_new_tokens=N)
  params = engine.load(model)
  prefix = engine.prefill(params, [[1, 2, 3]] * B)
  start = lambda: engine.insert(engine.init_decode_state(), prefix, list(range(B)), list(range(B)),
                                jax.random.split(jax.random.key(0), B))
  jax.block_until_ready(engine.generate(params, start()))  # compiles
  state = jax.block_until_ready(start())
  args = (params, state, engine.stop_ids, np.int32(N), np.int32(B + 1))
  got = profile(engine._generate, args, lambda: jax.block_until_ready(engine.generate(params, state)),
                units=N)
  share = {name: s for name, _, s in got["functions"]}
  assert got["total_us"] > 0
  assert share["decode.py:generate"] > 0.9, share
  for caller, callee in (("transformer.py:Transformer.__call__", "transformer.py:Block.__call__"),
                         ("transformer.py:Block.__call__", "transformer.py:MLP.__call__"),
                         ("transformer.py:Block.__call__", "transformer.py:Attention.__call__"),
                         ("decode.py:decode_step", "transformer.py:Transformer.__call__")):
    assert 0 < share[callee] <= share[caller] + 1e-9, (caller, callee, share)
  assert "attention.py:reference_attention" in share
  assert all(0 < s <= 1 + 1e-9 for s in share.values())
