"""Modular walk: a built-in, verifiable reasoning task with written steps.

Start at a number, add a fixed step modulo M, and write every value until
the target is reached. One word per token (see `tokenizer()`):

  prompt    5 +3 =2 ?          (M = 20: start 5, step +3, target 2)
  solution  8 11 14 17 0 3 6 9 12 15 18 1 4 7 10 13 16 19 2

The reward simulates the walk: it is 1 when every written value is the
previous one plus the step (mod M) and the solution stops exactly when it
first reaches the target.

Why this task: a small model trained from scratch on two CPU cores learns it
in minutes (each step reads the step word at a fixed place in the prompt and
applies an M x M addition table to the previous word), and it has what
rollout-efficiency techniques exploit: response length varies with the
problem (1 to M - 1 values, coefficient of variation about 0.5), and so
does difficulty, because a policy that slips with some probability per step
nearly always solves one-step walks and rarely solves long ones.

The warm start trains on `worked_solution(..., error_rate)`: each written
value is replaced by a wrong one with probability `error_rate` and the walk
goes on from it. The supervised policy then slips at about that rate per
step, and RL has to learn to stop slipping, which it can only do from the
reward.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxroll.tasks.base import Example
from jaxroll.tasks.word_tokenizer import WordTokenizer

MODULUS = 20


@dataclasses.dataclass(frozen=True)
class Problem:
  start: int
  step: int
  target: int

  @property
  def prompt(self) -> str:
    return f"{self.start} +{self.step} ={self.target} ?"

  def walk(self) -> list[int]:
    """The values written by a correct solution (ending at the target)."""
    out, v = [], self.start
    while True:
      v = (v + self.step) % MODULUS
      out.append(v)
      if v == self.target:
        return out

  @property
  def num_steps(self) -> int:
    return len(self.walk())


def tokenizer() -> WordTokenizer:
  words = [str(v) for v in range(MODULUS)]
  words += [f"+{s}" for s in range(1, MODULUS)] + [f"={v}" for v in range(MODULUS)] + ["?"]
  return WordTokenizer(words)


def draw_walk(rng: np.random.Generator) -> tuple[int, int, int]:
  """(start, step, target) of a solvable walk, drawn uniformly until one is."""
  while True:
    start, step, target = (int(x) for x in rng.integers(0, MODULUS, size=3))
    # Not: no step, nothing to do, or the target unreachable.
    if step and start != target and (target - start) % math.gcd(step, MODULUS) == 0:
      return start, step, target


def sample_problems(seed: int, count: int, max_steps: int = MODULUS - 1) -> list[Problem]:
  """`count` solvable problems with at most `max_steps` steps, from a seeded generator."""
  rng = np.random.default_rng(seed)
  problems = []
  while len(problems) < count:
    p = Problem(*draw_walk(rng))
    if p.num_steps <= max_steps:
      problems.append(p)
  return problems


def num_distinct_problems(max_steps: int = MODULUS - 1) -> int:
  """How many distinct solvable problems have at most `max_steps` steps (enumerated)."""
  return sum(
      1 for start in range(MODULUS) for step in range(1, MODULUS) for target in range(MODULUS)
      if start != target and (target - start) % math.gcd(step, MODULUS) == 0
      and Problem(start, step, target).num_steps <= max_steps)


def splits(seed: int, num_train: int, num_heldout: int,
           max_steps: int = MODULUS - 1) -> tuple[list[Example], list[Example]]:
  """Train and held-out examples; held-out prompts never appear in train.

  There are only a few thousand distinct problems, so train examples repeat
  (RL samples prompts many times anyway) but exclude the held-out set.
  """
  # Checked by enumeration first: sampling would draw 50 * num_heldout
  # problems (minutes for a large mistaken count) before it could tell.
  available = num_distinct_problems(max_steps)
  if num_heldout > available:
    raise ValueError(f"only {available} distinct problems for num_heldout={num_heldout}")
  heldout, seen = [], set()
  for p in sample_problems(seed, 50 * num_heldout, max_steps):
    if p not in seen:
      seen.add(p)
      heldout.append(p)
    if len(heldout) == num_heldout:
      break
  if len(heldout) < num_heldout:
    raise ValueError(f"only {len(heldout)} distinct problems for num_heldout={num_heldout}")
  train = [p for p in sample_problems(seed + 1, 2 * num_train, max_steps) if p not in seen]
  if len(train) < num_train:
    raise ValueError(f"num_heldout={num_heldout} leaves too few distinct train problems")
  as_examples = lambda ps: [Example(p.prompt, " ".join(map(str, p.walk())), p.num_steps) for p in ps]
  return as_examples(train[:num_train]), as_examples(heldout)


def parse_problem(prompt: str) -> Problem:
  """Inverse of Problem.prompt."""
  words = prompt.split()
  try:
    if len(words) != 4 or words[3] != "?" or words[1][0] != "+" or words[2][0] != "=":
      raise ValueError
    p = Problem(int(words[0]), int(words[1][1:]), int(words[2][1:]))
  except ValueError:
    raise ValueError(f"not a modular-walk prompt: {prompt!r}") from None
  if not (0 <= p.start < MODULUS and 0 < p.step < MODULUS and 0 <= p.target < MODULUS):
    raise ValueError(f"values of {prompt!r} are outside 0..{MODULUS - 1}")
  return p


def worked_solution(problem: Problem, rng: np.random.Generator, error_rate: float = 0.0) -> str:
  """A solution that slips at each step with probability `error_rate`.

  After a slip the walk continues from the wrong value; it stops at the
  target or, if a slip skipped it, after as many steps as the walk has.
  """
  written, v = [], problem.start
  for _ in range(problem.num_steps):
    v = (v + problem.step) % MODULUS
    if error_rate > 0 and rng.random() < error_rate:
      v = (v + int(rng.integers(1, MODULUS))) % MODULUS  # any other value, uniformly
    written.append(v)
    if v == problem.target:
      break
  return " ".join(map(str, written))


def reward(completion: str, answer: str) -> float:
  """1.0 when the completion is exactly the walk in `answer`, else 0.0.

  The reference walk is what a simulation of the prompt writes, so this
  equals checking every step and the stopping point.
  """
  return float(completion.split() == answer.split())
