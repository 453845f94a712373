"""Launches a jaxroll run on a SLURM GPU cluster, one process per node.

  python scripts/launch_slurm.py --nodes 2 --gpus-per-node 8 --partition P \
      --config configs/default.py [--set key=value ...] [--dry-run]

Submits an sbatch script whose srun step starts `jaxroll train` on every
node; the first node is the coordinator (JAXROLL_COORDINATOR), and each
process reads its rank from SLURM_PROCID. --dry-run prints the sbatch
command and the script instead of submitting.
"""

import argparse
import shlex
import subprocess
import sys


def batch_script(a) -> str:
  train = " ".join(shlex.quote(x) for x in
                   ["jaxroll", "train", a.config, *[x for s in a.set for x in ("--set", s)]])
  return "\n".join([
      "#!/bin/bash",
      f"#SBATCH --job-name={a.job_name}",
      f"#SBATCH --nodes={a.nodes}",
      "#SBATCH --ntasks-per-node=1",
      f"#SBATCH --gpus-per-node={a.gpus_per_node}",
      f"#SBATCH --partition={a.partition}",
      f"#SBATCH --time={a.time}",
      "set -euo pipefail",
      'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
      f"export JAXROLL_COORDINATOR=$head:{a.port}",
      f"export JAXROLL_NUM_PROCESSES={a.nodes}",
      f"cd {shlex.quote(a.workdir)}",
      # SLURM_PROCID is only set inside the srun step, hence the inner shell.
      f"srun bash -c 'JAXROLL_PROCESS_ID=$SLURM_PROCID exec {train}'",
      "",
  ])


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--nodes", type=int, required=True)
  ap.add_argument("--gpus-per-node", type=int, default=8)
  ap.add_argument("--partition", required=True)
  ap.add_argument("--time", default="04:00:00")
  ap.add_argument("--job-name", default="jaxroll")
  ap.add_argument("--port", type=int, default=12355)
  ap.add_argument("--workdir", default=".")
  ap.add_argument("--config", required=True)
  ap.add_argument("--set", action="append", default=[])
  ap.add_argument("--dry-run", action="store_true")
  a = ap.parse_args()
  script = batch_script(a)
  print("sbatch <<'EOF'\n" + script + "EOF")
  if not a.dry_run:
    out = subprocess.run(["sbatch"], input=script, text=True)
    sys.exit(out.returncode)


if __name__ == "__main__":
  main()
