"""Reads and writes safetensors files with NumPy alone (bfloat16 via ml_dtypes).

The format is an 8-byte little-endian header size, a JSON header mapping each
tensor name to dtype, shape and byte offsets, then the raw bytes.

`SafetensorsFile` reads one tensor at a time with a positioned read into a
fresh array: a loader that converts and frees each tensor before the next
holds at most one raw tensor beside the converted weights. (A memory map
would keep every page it touched resident, and counted in the process's
RSS, until the whole map is dropped: a second copy of the checkpoint.)
`load` memory-maps the whole file, for small files and tests.
"""

from __future__ import annotations

import json
import os
import struct as pystruct

import ml_dtypes
import numpy as np

from jaxroll.errors import JaxrollError

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class SafetensorsError(JaxrollError, ValueError):
  pass


def read_header(path: str) -> tuple[dict, int]:
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) != 8:
      raise SafetensorsError(f"{path}: too short to be a safetensors file")
    (n,) = pystruct.unpack("<Q", raw)
    if n > os.path.getsize(path) - 8:
      raise SafetensorsError(f"{path}: header size {n} exceeds the file size")
    header = json.loads(f.read(n))
  header.pop("__metadata__", None)
  return header, 8 + n


def check_complete(path: str) -> None:
  """Raises SafetensorsError when the header or a tensor's bytes run past
  the end of the file (a truncated download or copy), without reading data."""
  try:
    header, base = read_header(path)
  except json.JSONDecodeError:
    raise SafetensorsError(f"{path}: unreadable header (not a safetensors file?)") from None
  size = os.path.getsize(path)
  end = max((info["data_offsets"][1] for info in header.values()), default=0)
  if base + end > size:
    raise SafetensorsError(f"{path}: truncated ({size} bytes, its header needs {base + end}); "
                           "copy the checkpoint again")


class SafetensorsFile:
  """One safetensors file's header, and its tensors read on demand.

  Example:
    f = SafetensorsFile(path)
    w = f.read("model.norm.weight")  # a new, writable array
  """

  def __init__(self, path: str):
    self.path = path
    self.header, self.base = read_header(path)
    self._size = os.path.getsize(path)

  def names(self) -> list[str]:
    return list(self.header)

  def info(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
    """(dtype, shape) of tensor `name`, checked against its byte offsets."""
    entry = self.header[name]
    if entry["dtype"] not in _DTYPES:
      raise SafetensorsError(f"{self.path}: tensor {name!r} has unsupported dtype {entry['dtype']}")
    dtype, shape = np.dtype(_DTYPES[entry["dtype"]]), tuple(entry["shape"])
    start, end = entry["data_offsets"]
    count = int(np.prod(shape, dtype=np.int64))
    if end - start != count * dtype.itemsize or self.base + end > self._size:
      raise SafetensorsError(f"{self.path}: tensor {name!r} has inconsistent offsets (truncated file?)")
    return dtype, shape

  def read(self, name: str) -> np.ndarray:
    dtype, shape = self.info(name)
    start, end = self.header[name]["data_offsets"]
    out = np.empty(shape, dtype)
    view = memoryview(out.reshape(-1).view(np.uint8))
    with open(self.path, "rb", buffering=0) as f:
      f.seek(self.base + start)
      done = 0
      while done < end - start:  # raw reads may return fewer bytes than asked
        n = f.readinto(view[done:])
        if not n:
          raise SafetensorsError(f"{self.path}: tensor {name!r} ends early (truncated file?)")
        done += n
    return out


def load(path: str) -> dict[str, np.ndarray]:
  """Returns {name: array} memory-mapped from `path` (read-only)."""
  f = SafetensorsFile(path)
  mm = np.memmap(path, dtype=np.uint8, mode="r")
  out = {}
  for name in f.names():
    dtype, shape = f.info(name)
    start, end = f.header[name]["data_offsets"]
    out[name] = mm[f.base + start:f.base + end].view(dtype).reshape(shape)
  return out


def save(path: str, tensors: dict[str, np.ndarray]) -> None:
  """Writes {name: array} as one safetensors file."""
  header, offset, blobs = {}, 0, []
  for name, arr in tensors.items():
    arr = np.ascontiguousarray(arr)
    blob = arr.tobytes()
    header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                    "data_offsets": [offset, offset + len(blob)]}
    offset += len(blob)
    blobs.append(blob)
  raw = json.dumps(header).encode()
  raw += b" " * (-len(raw) % 8)
  with open(path, "wb") as f:
    f.write(pystruct.pack("<Q", len(raw)))
    f.write(raw)
    for blob in blobs:
      f.write(blob)
