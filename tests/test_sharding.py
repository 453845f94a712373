"""Sharding: meshes and rules, and sharded == single-device on 8 fake CPU devices."""

import json
import os
import subprocess
import sys

import jax
import pytest
from flax import nnx

from jaxroll import sharding as sh
from jaxroll.model import Transformer

from small_models import small_config

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
  run_dir = str(tmp_path_factory.mktemp("sharded") / "run")
  out = subprocess.run([sys.executable, os.path.join(HERE, "sharding_checks.py"), run_dir],
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_sharded_train_step_equals_single_device(checks):
  assert checks["devices"] == 8
  t = checks["train"]
  assert abs(t["loss"][0] - t["loss"][1]) < 1e-6
  assert t["max_param_diff"] < 1e-5


def test_parameters_really_are_sharded_and_stay_so(checks):
  t = checks["train"]
  assert t["layout_before"]["layers/0/mlp/gate_up/kernel"] == "P('fsdp', 'tensor')"
  assert t["layout_before"]["layers/0/mlp/down/kernel"] == "P('tensor', 'fsdp')"
  assert t["gate_up_devices"] == 8
  assert t["gate_up_shard_shape"] == [64 // 2, 2 * 128 // 4]  # [E / fsdp, 2F / tensor]
  assert t["layout_after"] == t["layout_before"]
  assert t["mu_layout"] == "P('fsdp', 'tensor')"  # Adam's moments follow their parameter


def test_sharded_sampling_gives_the_same_tokens(checks):
  s = checks["sampling"]
  assert s["tokens_equal"] and s["lengths_equal"] and s["max_logp_diff"] < 1e-5
  assert s["param_spec"] == "P('fsdp', 'tensor')"
  assert s["state_spec"] == "P(('data', 'fsdp'),)"  # slots split over the batch axes


def test_training_loop_runs_on_a_mesh(checks):
  t = checks["trainer"]
  assert t["steps"] == [0, 1, 2, 3]
  # The task vocabulary (63 words) does not divide by 4: replicated; width 32 splits over fsdp=2.
  assert t["embed_spec"] == "P(None, 'fsdp')"
  assert t["train_devices"] == list(range(8)) and t["sync_bytes"] == [0, 0, 0]


def test_disaggregated_run_reports_weight_sync(checks):
  d = checks["disaggregated"]
  assert d["steps"] == [0, 1, 2, 3]
  assert d["train_devices"] == [4, 5, 6, 7]  # the rollout mesh has devices 0-3
  assert d["sync_bytes"] == [d["param_bytes"]] * 3
  assert all(s is not None and s > 0 for s in d["sync_seconds"])


def test_rollout_thread_samples_on_its_own_sub_mesh(checks):
  d = checks["async_disaggregated"]
  assert d["steps"] == [0, 1, 2, 3]
  assert d["train_devices"] == [4, 5, 6, 7]
  assert all(0 <= lag <= 1 for lag in d["lags"]) and all(b > 0 for b in d["sync_bytes"])


def test_mesh_that_does_not_fit_the_devices_is_rejected():
  import jax

  n = jax.device_count()
  with pytest.raises(sh.ShardingError, match=f"there are {n} devices"):
    sh.make_mesh({"fsdp": n + 1})
  with pytest.raises(sh.ShardingError, match="unknown mesh axes"):
    sh.make_mesh({"expert": 1})
  with pytest.raises(sh.ShardingError, match="only one mesh axis may be -1"):
    sh.make_mesh({"data": -1, "fsdp": -1})
  assert sh.make_mesh({"data": -1}).shape["data"] == n


def test_rule_naming_an_unknown_axis_is_rejected_before_compiling():
  _, params = nnx.split(Transformer(small_config(), rngs=nnx.Rngs(0)))
  # One device whatever XLA_FLAGS gives the process: a 1x1x1 mesh needs exactly one.
  mesh = sh.make_mesh({}, jax.devices()[:1])
  with pytest.raises(sh.ShardingError, match="'mlp' -> 'model' names an unknown mesh axis"):
    sh.param_shardings(params, mesh, {**sh.DEFAULT_RULES, "mlp": "model"})


def test_axes_that_do_not_divide_a_dimension_are_dropped():
  # A 2x4 mesh needs 8 devices; the spec arithmetic only needs the shape.
  class FakeMesh:
    shape = {"data": 1, "fsdp": 2, "tensor": 4}
    axis_names = sh.MESH_AXES

  assert str(sh.spec_for((48, 96), ("embed", "mlp"), FakeMesh())) == "P('fsdp', 'tensor')"
  assert str(sh.spec_for((47, 6), ("embed", "mlp"), FakeMesh())) == "P(None, None)"
  assert str(sh.spec_for((8, 3), ("batch", None), FakeMesh())) == "P(('data', 'fsdp'), None)"
  assert str(sh.spec_for((3, 3), ("batch", None), FakeMesh())) == "P('data', None)"
