"""Reads and writes safetensors files with NumPy alone (bfloat16 via ml_dtypes).

The format is an 8-byte little-endian header size, a JSON header mapping each
tensor name to dtype, shape and byte offsets, then the raw bytes. Reading
memory-maps the file, so a large checkpoint is not copied until used.
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


def load(path: str) -> dict[str, np.ndarray]:
  """Returns {name: array} memory-mapped from `path` (read-only)."""
  header, base = read_header(path)
  mm = np.memmap(path, dtype=np.uint8, mode="r")
  out = {}
  for name, info in header.items():
    if info["dtype"] not in _DTYPES:
      raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
    start, end = info["data_offsets"]
    dtype = np.dtype(_DTYPES[info["dtype"]])
    count = int(np.prod(info["shape"], dtype=np.int64))
    if end - start != count * dtype.itemsize or base + end > mm.size:
      raise SafetensorsError(f"{path}: tensor {name!r} has inconsistent offsets (truncated file?)")
    out[name] = mm[base + start:base + end].view(dtype).reshape(info["shape"])
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
