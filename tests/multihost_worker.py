"""One process of the two-process test (tests/test_multihost.py).

  python tests/multihost_worker.py COORDINATOR_PORT PROCESS_ID OUT_DIR [step|train [KEY=VALUE ...]]

Each process has 4 fake CPU devices; together they form one global mesh
through jax.distributed.initialize on a loopback coordinator. "step" runs
three sharded train steps of a tiny model on a 2x4 (fsdp x tensor) mesh,
saves one orbax checkpoint together into OUT_DIR and prints the losses as
JSON; "train" runs the training loop (tests/test_training.py's tiny config)
into OUT_DIR, each process sampling its half of the prompts, with the
config overrides that follow "train".
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process CPU collectives

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxroll import distributed  # noqa: E402


def train_loop(run_dir, *overrides):
  from test_training import tiny

  from jaxroll import config as config_lib
  from jaxroll.train import train

  cfg = tiny(run_dir, "report=false", "mesh.fsdp=-1", "eval_every=3", *overrides)
  result = train(config_lib.apply_overrides(cfg, ["steps=3"]))
  # Both processes restore the step-3 checkpoint and continue to step 4 together.
  resumed = train(config_lib.apply_overrides(cfg, ["steps=4"]), resume=True)
  print(json.dumps({"process": jax.process_index(), "result": result, "resumed": resumed}))


def main():
  port, process_id, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
  distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                         initialization_timeout=60)
  if sys.argv[4:5] == ["train"]:
    train_loop(out_dir, *sys.argv[5:])
  else:
    train_steps(out_dir)
  distributed.shutdown()


def train_steps(ckpt_dir):
  from small_models import small_config

  from jaxroll import sharding as sh
  from jaxroll.checkpoint import Checkpointer
  from jaxroll.model import Transformer
  from jaxroll.rl.optim import adamw_warmup_cosine
  from jaxroll.rl.train_step import RLBatch, make_update
  from jaxroll.rollout import SamplingParams

  assert jax.device_count() == 8 and jax.local_device_count() == 4
  mesh = sh.make_mesh({"fsdp": 2, "tensor": 4})
  graphdef, params = nnx.split(Transformer(small_config(hidden_size=64, mlp_dim=128), rngs=nnx.Rngs(0)))
  tx, _ = adamw_warmup_cosine(learning_rate=1e-3, total_steps=3)
  psh = sh.param_shardings(params, mesh)
  params = sh.shard_like(params, psh)  # same values on every process: a global array each
  opt = tx.init(params)
  osh = sh.optimizer_shardings(opt, psh, mesh)
  opt = sh.shard_like(opt, osh)
  update = make_update(graphdef, tx, sampling=SamplingParams(), minibatches=1, clip_low=0.2,
                       clip_high=0.2, aggregation="token_mean", kl_coef=0.0, state_shardings=(psh, osh))
  losses = []
  for step in range(3):
    rng = np.random.default_rng(step)  # every process builds the same global batch
    N, T = 16, 12
    tokens, mask = rng.integers(0, 64, (N, T)).astype(np.int32), rng.random((N, T)) < 0.7
    batch = RLBatch(tokens, mask, (-rng.random((N, T)) * 3).astype(np.float32),
                    rng.normal(size=N).astype(np.float32), mask)
    batch = sh.shard_like(batch, RLBatch(*[sh.batch_sharding(mesh, np.ndim(x), rows=N) for x in batch]))
    params, opt, stats = update(params, opt, batch, None)
    losses.append(float(stats["loss"]))
  ckpt = Checkpointer(ckpt_dir, keep=1)
  ckpt.save(3, params, opt, {"step": 3, "losses": losses})
  ckpt.close()
  print(json.dumps({"process": jax.process_index(), "losses": losses,
                    "local_shards": len(params["layers"][0]["mlp"]["gate_up"]["kernel"][...].addressable_shards)}))


if __name__ == "__main__":
  main()
