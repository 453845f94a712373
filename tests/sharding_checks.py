"""Sharded-vs-single-device checks, run in a process with 8 fake CPU devices.

`python tests/sharding_checks.py RUN_DIR` sets XLA_FLAGS before importing jax, runs
each check and prints one JSON object of results; tests/test_sharding.py
asserts on it. A separate process because the device count is fixed when
jax starts.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from small_models import small_config, small_model  # noqa: E402

from jaxroll import sharding as sh  # noqa: E402
from jaxroll.model import Transformer  # noqa: E402
from jaxroll.rl.optim import adamw_warmup_cosine  # noqa: E402
from jaxroll.rl.train_step import RLBatch, make_update  # noqa: E402
from jaxroll.rollout import RolloutEngine, SamplingParams  # noqa: E402

SHAPE = dict(hidden_size=64, num_heads=4, num_kv_heads=2, mlp_dim=128, vocab_size=64)


def train_step_check(mesh):
  graphdef, params = nnx.split(Transformer(small_config(**SHAPE), rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  N, T = 16, 12
  tokens, mask = rng.integers(0, 64, (N, T)).astype(np.int32), rng.random((N, T)) < 0.7
  batch = RLBatch(tokens, mask, (-rng.random((N, T)) * 3).astype(np.float32),
                  rng.normal(size=N).astype(np.float32), mask)
  tx, _ = adamw_warmup_cosine(learning_rate=1e-3, total_steps=10, warmup_steps=0)
  kw = dict(sampling=SamplingParams(), minibatches=2, clip_low=0.2, clip_high=0.2,
            aggregation="token_mean", kl_coef=0.0)
  single = make_update(graphdef, tx, **kw)
  p1, _, s1 = single(jax.tree.map(jnp.array, params), tx.init(params), batch, None)

  psh = sh.param_shardings(params, mesh)
  placed = sh.shard_like(params, psh)
  opt = tx.init(placed)
  osh = sh.optimizer_shardings(opt, psh, mesh)
  opt = sh.shard_like(opt, osh)
  before = sh.describe_layout(placed)
  sharded = make_update(graphdef, tx, state_shardings=(psh, osh), **kw)
  bsh = RLBatch(*[sh.batch_sharding(mesh, np.ndim(x), rows=N) for x in batch])
  p2, o2, s2 = sharded(placed, opt, sh.shard_like(batch, bsh), None)
  return {
      "loss": [float(s1["loss"]), float(s2["loss"])],
      "max_param_diff": max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2))),
      "layout_before": before, "layout_after": sh.describe_layout(p2),
      "gate_up_devices": len(p2["layers"][0]["mlp"]["gate_up"]["kernel"][...].sharding.device_set),
      "gate_up_shard_shape": list(p2["layers"][0]["mlp"]["gate_up"]["kernel"][...].addressable_shards[0].data.shape),
      "mu_layout": sh.describe_layout(o2[1][0].mu)["layers/0/mlp/gate_up/kernel"],
  }


def sampling_check(mesh):
  model = small_model(0, **SHAPE)
  _, state = nnx.split(model)
  prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [3, 4], [7]]
  kw = dict(num_slots=8, max_prompt_len=8, max_new_tokens=10, stop_token_ids=[3],
            sampling=SamplingParams(0.9, top_k=20))
  single = RolloutEngine.for_model(model, **kw)
  t1 = single.rollout(single.load(state), prompts, group_size=4, key=jax.random.key(1))
  sharded = RolloutEngine.for_model(model, mesh=mesh, **kw)
  params = sharded.load(sh.shard_like(state, sh.param_shardings(state, mesh)))
  t2 = sharded.rollout(params, prompts, group_size=4, key=jax.random.key(1))
  return {"tokens_equal": bool(np.array_equal(t1.tokens_NxL, t2.tokens_NxL)),
          "lengths_equal": bool(np.array_equal(t1.length_N, t2.length_N)),
          "max_logp_diff": float(np.abs(t1.logp_NxL - t2.logp_NxL).max()),
          "param_spec": str(params.state["layers"][0]["mlp"]["gate_up"]["kernel"][...].sharding.spec),
          "state_spec": str(sharded.init_decode_state().token_B.sharding.spec)}


def trainer_check(run_dir, *placement):
  """The training loop on a mesh: colocated 2x4 (fsdp x tensor), or disaggregated."""
  from test_training import tiny

  from jaxroll.metrics.logger import read_jsonl
  from jaxroll.train import Trainer

  trainer = Trainer(tiny(run_dir, "steps=3", "eval_every=3", "report=false", *placement))
  trainer.run()
  metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  timing = read_jsonl(os.path.join(run_dir, "timing.jsonl"))
  return {"steps": [m["step"] for m in metrics],
          "embed_spec": sh.describe_layout(trainer.learner.params)["embed/embedding"],
          "train_devices": sorted(d.id for d in trainer.learner.params["embed"]["embedding"][...].sharding.device_set),
          "sync_bytes": [m.get("weight_sync_bytes") for m in metrics[1:]],
          "param_bytes": sum(x.nbytes for x in jax.tree.leaves(trainer.learner.params)),
          "sync_seconds": [t.get("weight_sync_s") for t in timing[1:]],
          "lags": [m.get("policy_lag") for m in metrics[1:]]}


if __name__ == "__main__":
  mesh = sh.make_mesh({"fsdp": 2, "tensor": 4})
  print(json.dumps({"devices": jax.device_count(), "train": train_step_check(mesh),
                    "sampling": sampling_check(sh.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})),
                    "trainer": trainer_check(sys.argv[1] + "_colocated", "mesh.fsdp=2", "mesh.tensor=4"),
                    "disaggregated": trainer_check(
                        sys.argv[1] + "_disaggregated", "mesh.placement=disaggregated",
                        "mesh.rollout_devices=4", "mesh.fsdp=2", "mesh.tensor=2"),
                    # The rollout thread on its own sub-mesh, one version ahead.
                    "async_disaggregated": trainer_check(
                        sys.argv[1] + "_async", "mesh.placement=disaggregated", "mesh.rollout_devices=4",
                        "mesh.fsdp=2", "mesh.tensor=2", "pipeline.mode=async", "pipeline.max_lag=1",
                        "rl.off_policy=tis")}))
