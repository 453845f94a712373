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


@pytest.mark.slow
def test_two_processes_train_checkpoint_and_agree(tmp_path):
  port, ckpt = _free_port(), str(tmp_path / "ckpt")
  procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_worker.py"), str(port),
                             str(i), ckpt], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  deadline = time.monotonic() + 240  # the test stops itself: no hang if a peer never joins
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
  assert sorted(o["process"] for o in outs) == [0, 1]
  assert outs[0]["losses"] == outs[1]["losses"] and len(outs[0]["losses"]) == 3
  assert all(o["local_shards"] == 4 for o in outs)  # each process holds its half of the mesh

  from jaxroll.checkpoint import Checkpointer

  reader = Checkpointer(ckpt)
  assert reader.latest_step() == 3
  assert reader.read_meta(3)["losses"] == outs[0]["losses"]
  reader.close()
