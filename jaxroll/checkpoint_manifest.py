"""The commit record of a checkpoint: a manifest of its files, written last.

A checkpoint step folder `<folder>/<step>/` counts as committed only once
`MANIFEST` is in it. The manifest lists every file orbax wrote, with its
size and CRC32, and carries the step's run metadata (the JSON record a
resume needs). So:
  - a run killed at any instant of a save leaves either a committed
    checkpoint or a folder without a manifest, which is set aside;
  - a committed checkpoint damaged later (a truncated array file, deleted
    metadata, overwritten bytes) fails `verify`, is named, set aside, and
    the previous committed checkpoint is used;
  - the metadata of a checkpoint is read without orbax or JAX (the run
    folder checks run before JAX starts).
This module imports neither JAX nor orbax.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from typing import Any

from jaxroll.config import flat_differences
from jaxroll.errors import JaxrollError

MANIFEST = "jaxroll_manifest.json"
_CHUNK = 1 << 22


class CheckpointMismatchError(JaxrollError, ValueError):
  """The checkpoint folder was written by an incompatible config."""


class CheckpointCorruptError(JaxrollError):
  """No intact checkpoint is left to restore."""


def _crc32(path: str) -> int:
  crc = 0
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      crc = zlib.crc32(chunk, crc)
  return crc


def _files(step_dir: str) -> list[str]:
  out = []
  for root, _, names in os.walk(step_dir):
    for name in names:
      rel = os.path.relpath(os.path.join(root, name), step_dir)
      if rel != MANIFEST:
        out.append(rel)
  return sorted(out)


def _fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def write_manifest(step_dir: str, meta: dict[str, Any]) -> None:
  """Commits the checkpoint in `step_dir`: lists its files, then renames
  the manifest into place (atomic), so a half-written manifest never counts."""
  files = {rel: [os.path.getsize(os.path.join(step_dir, rel)), _crc32(os.path.join(step_dir, rel))]
           for rel in _files(step_dir)}
  tmp = os.path.join(step_dir, MANIFEST + ".tmp")
  with open(tmp, "w") as f:
    json.dump({"files": files, "meta": meta}, f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, os.path.join(step_dir, MANIFEST))
  _fsync_dir(step_dir)


def committed_steps(folder: str) -> list[int]:
  """The steps under `folder` whose manifest was written, oldest first."""
  if not os.path.isdir(folder):
    return []
  return sorted(int(d) for d in os.listdir(folder)
                if d.isdigit() and os.path.isfile(os.path.join(folder, d, MANIFEST)))


def read_manifest(folder: str, step: int) -> dict[str, Any]:
  with open(os.path.join(folder, str(step), MANIFEST)) as f:
    return json.load(f)


def read_meta(folder: str, step: int) -> dict[str, Any]:
  return read_manifest(folder, step)["meta"]


def verify(folder: str, step: int) -> str | None:
  """None when every file of the checkpoint is as committed, else what is wrong."""
  step_dir = os.path.join(folder, str(step))
  try:
    files = read_manifest(folder, step)["files"]
  except (OSError, ValueError, KeyError) as e:
    return f"unreadable manifest ({e})"
  for rel, (size, crc) in sorted(files.items()):
    path = os.path.join(step_dir, rel)
    if not os.path.isfile(path):
      return f"{rel} is missing"
    if os.path.getsize(path) != size:
      return f"{rel} has {os.path.getsize(path)} bytes, {size} were written"
    if _crc32(path) != crc:
      return f"{rel} does not match its checksum"
  return None


def set_aside(folder: str, name: str) -> str:
  """Moves `folder/name` into `folder.set_aside/` (kept for inspection,
  out of orbax's sight); returns where it went."""
  dest_root = folder.rstrip("/") + ".set_aside"
  os.makedirs(dest_root, exist_ok=True)
  dest, n = os.path.join(dest_root, name), 1
  while os.path.exists(dest):
    dest, n = os.path.join(dest_root, f"{name}.{n}"), n + 1
  shutil.move(os.path.join(folder, name), dest)
  return dest


def set_aside_uncommitted(folder: str) -> list[str]:
  """Sets aside every entry of `folder` that is not a committed step
  (a save killed before its manifest, orbax's temporary folders)."""
  if not os.path.isdir(folder):
    return []
  committed = {str(s) for s in committed_steps(folder)}
  return [set_aside(folder, d) for d in sorted(os.listdir(folder)) if d not in committed]


def decommit(folder: str, step: int) -> None:
  """Deletes a committed step: the manifest first, so a deletion cut short
  leaves an uncommitted folder rather than a damaged committed one."""
  step_dir = os.path.join(folder, str(step))
  os.remove(os.path.join(step_dir, MANIFEST))
  shutil.rmtree(step_dir)


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any], folder: str) -> None:
  """Raises CheckpointMismatchError naming the config keys (or parameter
  shapes) in which a checkpoint's fingerprint differs from this run's.
  A `current` without "param_shapes" checks the config keys alone."""
  diffs = flat_differences(saved.get("config", {}), current.get("config", {}), "checkpoint", "this run")
  if not diffs and "param_shapes" in current and saved.get("param_shapes") != current["param_shapes"]:
    diffs.append("parameter shapes differ")
  if diffs:
    raise CheckpointMismatchError(
        f"{folder} was written by an incompatible config ({'; '.join(diffs)}); "
        "resume with the run's own config.json or use a new run_dir")
