"""GSM8K / MATH-style question-answer files and a math-verify reward.

A file is JSONL (one JSON object per line) or Parquet with a question and an
answer column. GSM8K answers end with `#### <number>`; only that final part
is kept as the reference.
"""

from __future__ import annotations

import json
import logging
import os

from jaxroll.errors import JaxrollError
from jaxroll.tasks.base import Example


class DatasetError(JaxrollError, ValueError):
  """A dataset file cannot be used as configured."""


def _reference(answer) -> str:
  text = str(answer)
  return text.split("####")[-1].strip() if "####" in text else text.strip()


def load_qa_file(path: str, *, question_key: str = "question", answer_key: str = "answer",
                 prompt_template: str = "{question}", on_bad_line: str = "error",
                 stats: dict | None = None) -> list[Example]:
  """Reads examples from a .jsonl / .json-lines or .parquet file.

  Args:
    path: the file.
    question_key, answer_key: the fields holding the question and answer.
    prompt_template: formats the question into the prompt; `{question}` is
      replaced.
    on_bad_line: "error" raises DatasetError naming the first bad line;
      "skip" drops bad lines and counts them in `stats["skipped_lines"]`.
    stats: optional dict that receives {"skipped_lines", "rows"}.

  Returns:
    The examples, in file order.
  """
  if on_bad_line not in ("error", "skip"):
    raise DatasetError(f"on_bad_line must be 'error' or 'skip', got {on_bad_line!r}")
  if not os.path.isfile(path):
    raise DatasetError(f"{path}: no such dataset file")
  if "{question}" not in prompt_template:
    raise DatasetError(f"prompt_template {prompt_template!r} has no {{question}} placeholder")
  rows = []  # (line number, record or None, problem)
  if path.endswith(".parquet"):
    import pyarrow.parquet as pq  # only Parquet users need pyarrow

    table = pq.read_table(path)
    for i, rec in enumerate(table.to_pylist(), start=1):
      rows.append((i, rec, None))
  else:
    with open(path, encoding="utf-8") as f:
      for i, line in enumerate(f, start=1):
        if not line.strip():
          continue
        try:
          rows.append((i, json.loads(line), None))
        except json.JSONDecodeError as e:
          rows.append((i, None, f"invalid JSON ({e.msg})"))
  examples, skipped = [], 0
  for i, rec, problem in rows:
    if problem is None and not isinstance(rec, dict):
      problem = "not a JSON object"
    if problem is None:
      missing = [k for k in (question_key, answer_key) if rec.get(k) in (None, "")]
      if missing:
        problem = f"missing field(s) {missing}"
    if problem is not None:
      if on_bad_line == "error":
        raise DatasetError(f"{path}:{i}: {problem}; fix the line or set on_bad_line='skip'")
      skipped += 1
      logging.getLogger(__name__).warning("%s:%d skipped: %s", path, i, problem)
      continue
    examples.append(Example(prompt_template.format(question=rec[question_key]),
                            _reference(rec[answer_key])))
  if stats is not None:
    stats.update(skipped_lines=skipped, rows=len(rows))
  if not examples:
    raise DatasetError(f"{path}: no usable rows ({skipped} skipped)")
  return examples


def math_verify_reward(completion: str, answer: str) -> float:
  """1.0 when math-verify finds the completion's answer equal to the reference.

  math-verify's own signal-based timeouts only work on the main thread; the
  RewardRunner enforces the timeout instead, so they are disabled here.
  """
  from math_verify import parse, verify  # optional at import time of jaxroll

  gold = parse(answer, parsing_timeout=None)
  pred = parse(completion, parsing_timeout=None)
  if not gold or not pred:
    return 0.0
  return float(verify(gold, pred, timeout_seconds=None))
