"""Launches a jaxroll run on every worker of a Cloud TPU pod slice.

  python scripts/launch_tpu_pod.py --tpu NAME --zone ZONE [--project P] \
      --config configs/default.py [--set key=value ...] [--dry-run]

Each worker runs the same `jaxroll train` command; JAX's TPU runtime finds
the other workers itself (JAXROLL_DISTRIBUTED=auto). --dry-run prints the
exact commands instead of running them.
"""

import argparse
import shlex
import subprocess
import sys


def commands(a) -> list[list[str]]:
  train = ["jaxroll", "train", a.config, *[x for s in a.set for x in ("--set", s)]]
  remote = (f"cd {shlex.quote(a.workdir)} && JAXROLL_DISTRIBUTED=auto "
            + " ".join(shlex.quote(x) for x in train))
  base = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", a.tpu, f"--zone={a.zone}", "--worker=all"]
  if a.project:
    base.append(f"--project={a.project}")
  return [base + [f"--command={remote}"]]


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--tpu", required=True)
  ap.add_argument("--zone", required=True)
  ap.add_argument("--project")
  ap.add_argument("--config", required=True)
  ap.add_argument("--set", action="append", default=[])
  ap.add_argument("--workdir", default="jaxroll", help="the repository on each worker (relative to home)")
  ap.add_argument("--dry-run", action="store_true")
  a = ap.parse_args()
  for cmd in commands(a):
    print(shlex.join(cmd))
    if not a.dry_run:
      rc = subprocess.call(cmd)
      if rc:
        sys.exit(rc)


if __name__ == "__main__":
  main()
