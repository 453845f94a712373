"""Two local processes x 4 fake CPU devices join through jax.distributed and train together."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_two(out_dir, *mode):
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_worker.py"), str(port),
                             str(i), out_dir, *mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
           for i in range(2)]
  deadline = time.monotonic() + 300  # the test stops itself: no hang if a peer never joins
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=max(deadline - time.monotonic(), 1))
      assert p.returncode == 0, err[-3000:]
      outs.append(json.loads(out.strip().splitlines()[-1]))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return outs


@pytest.mark.slow
def test_two_processes_train_checkpoint_and_agree(tmp_path):
  ckpt = str(tmp_path / "ckpt")
  outs = _run_two(ckpt)
  assert sorted(o["process"] for o in outs) == [0, 1]
  assert outs[0]["losses"] == outs[1]["losses"] and len(outs[0]["losses"]) == 3
  assert all(o["local_shards"] == 4 for o in outs)  # each process holds its half of the mesh

  from jaxroll.checkpoint import Checkpointer

  reader = Checkpointer(ckpt)
  assert reader.latest_step() == 3
  assert reader.read_meta(3)["losses"] == outs[0]["losses"]
  reader.close()


@pytest.mark.slow
def test_training_loop_across_two_processes_matches_one(tmp_path):
  """Each process samples half the prompts; the first step equals a one-process run."""
  from test_training import tiny

  from jaxroll.metrics.logger import read_jsonl
  from jaxroll.train import train

  run_dir = str(tmp_path / "two")
  outs = _run_two(run_dir, "train")
  assert [o["process"] for o in outs] == [0, 1] and outs[1]["result"] == {}
  assert outs[0]["result"]["steps"] == 3 and outs[0]["resumed"]["steps"] == 4
  two = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  assert [m["step"] for m in two] == [0, 1, 2, 3, 4]  # resumed together from step 3
  assert two[-1]["cumulative_rollouts"] == 4 * 16
  one_dir = str(tmp_path / "one")
  train(tiny(one_dir, "steps=1", "eval_every=1", "report=false"))
  one = read_jsonl(os.path.join(one_dir, "metrics.jsonl"))
  # Same warm start and the same per-row keys: the same samples and rewards.
  assert two[0]["heldout_accuracy"] == one[0]["heldout_accuracy"]
  for key in ("reward_mean", "length_mean", "tokens_generated", "degenerate_groups"):
    assert two[1][key] == one[1][key], key


@pytest.mark.slow
@pytest.mark.parametrize("mode", [["pipeline.mode=sync"],
                                  ["pipeline.mode=async", "pipeline.max_lag=1", "rl.off_policy=tis"]])
def test_over_provisioning_with_carry_over_runs_across_two_processes(tmp_path, mode):
  """Each process launches 1.25x its share (LPT admission), carries its
  unfinished groups over, and draws prompts from its own slice of the stream
  at its own pace; the checkpoint keeps every process's pool, queue and
  stream position, so the resumed run loses and repeats no batch. Async:
  each process's rollout thread samples its half one version ahead, while
  the update, publication, evaluation and checkpoints stay in the main
  threads, in step on both processes. GRESO plans every process's prompts
  from one replicated replay state, which each learner step rebuilds from
  both processes' writes (jaxroll.loop.shared_state: a digest compared
  across processes stops the run if the copies ever differ); a pool of 8
  prompts revisited every other step and its fast adaptation (greso_step
  0.5) make it skip prompts within these steps."""
  from jaxroll.loop.invariants import violations
  from jaxroll.metrics.logger import read_jsonl

  run_dir = str(tmp_path / "over")
  outs = _run_two(run_dir, "train", *mode, "schedule.order=lpt", "schedule.over_provision=1.25",
                  "rollout.num_slots=4", "algorithm.techniques=greso", "algorithm.greso_step=0.5",
                  "task.num_train=8")
  assert outs[0]["result"]["steps"] == 3 and outs[0]["resumed"]["steps"] == 4
  steps = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  assert [m["step"] for m in steps] == [0, 1, 2, 3, 4]
  assert violations(run_dir) == []
  # Groups were launched beyond the first batch's 4 and carried over.
  assert steps[1]["groups_launched"] > 4
  assert any(m["rows_carried_over"] > 0 for m in steps[1:])
  assert sum(m["prompts_skipped"] for m in steps[1:]) > 0  # GRESO acted on the shared record
  if "pipeline.mode=async" in mode:
    assert any(m["policy_lag"] == 1 for m in steps[1:])
