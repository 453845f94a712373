"""Lap walk: the modular walk repeated for a heavy-tailed number of laps.

The reasoning-shaped built-in task: long chains of written steps whose
length varies by more than an order of magnitude between problems, each
step checkable. One word per token:

  prompt    5 +3 =2 x3 ?          (start 5, step +3, target 2, 3 laps)
  solution  8 11 14 17 0 3 6 9 12 15 18 1 4 7 10 13 16 19 2 #2
            5 8 11 14 17 0 3 6 9 12 15 18 1 4 7 10 13 16 19 2 #1
            5 8 ... 19 2 #0

Each written value is the previous one plus the step modulo 20; each time
the walk reaches the target it writes a countdown marker `#r` (the laps
still to go) and it stops after `#0`. Every token depends on the tokens
just before it and a fixed part of the prompt: the step (or, equally, the
difference of the last two values), the target (the value before the last
marker, after the first lap) and the previous marker. Nothing needs a
count over the whole response, so a small model trained from scratch can
learn the rule and apply it at any length.

Lengths: the first lap walks from the start to the target (1 to c - 1
values, c = 20 / gcd(step, 20) the cycle), each further lap is c values,
plus one marker per lap. The number of laps is drawn from a log-normal
(median `lap_median`, shape `lap_sigma`) capped at `max_laps`, so
response lengths are long-tailed: a few problems take ten times the
median (survey Section 3: long chains of very uneven length).

Rewards (both exact): "chain" is 1 when the response is exactly the
reference walk; "final" is 1 when the response ends the countdown at the
target (`<target> #0`), however it got there.

The warm start trains on `worked_solution(..., error_rate)`: each written
value slips to a wrong one with probability `error_rate` and the walk goes
on from it, so the supervised policy slips at about that rate per value;
on a chain of hundreds of values that makes long problems nearly always
wrong and short ones mostly right, and RL has to drive the slip rate down.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

import numpy as np

from jaxroll.tasks import mod_walk
from jaxroll.tasks.base import Example
from jaxroll.tasks.word_tokenizer import WordTokenizer

MODULUS = mod_walk.MODULUS
REWARDS = ("chain", "final")


@dataclasses.dataclass(frozen=True)
class Problem:
  start: int
  step: int
  target: int
  laps: int

  @property
  def prompt(self) -> str:
    return f"{self.start} +{self.step} ={self.target} x{self.laps} ?"

  @property
  def cycle(self) -> int:
    return MODULUS // math.gcd(self.step, MODULUS)

  def solution(self) -> list[str]:
    """The words of the correct response."""
    out, v = [], self.start
    for remaining in range(self.laps - 1, -1, -1):
      while True:
        v = (v + self.step) % MODULUS
        out.append(str(v))
        if v == self.target:
          break
      out.append(f"#{remaining}")
    return out

  @property
  def num_tokens(self) -> int:
    first = next(k for k in range(1, self.cycle + 1)
                 if (self.start + k * self.step) % MODULUS == self.target)
    return first + (self.laps - 1) * self.cycle + self.laps


def tokenizer(max_laps: int) -> WordTokenizer:
  words = [str(v) for v in range(MODULUS)]
  words += [f"+{s}" for s in range(1, MODULUS)] + [f"={v}" for v in range(MODULUS)]
  words += [f"x{k}" for k in range(1, max_laps + 1)] + [f"#{r}" for r in range(max_laps)] + ["?"]
  return WordTokenizer(words)


def _draws(rng: np.random.Generator, *, max_laps: int, lap_median: float, lap_sigma: float,
           max_tokens: int | None, limit: int):
  """Problems that fit `max_tokens`, drawn one by one; at most `limit` draws."""
  for _ in range(limit):
    walk = mod_walk.draw_walk(rng)
    laps = int(np.clip(round(lap_median * math.exp(lap_sigma * rng.standard_normal())), 1, max_laps))
    p = Problem(*walk, laps)
    if max_tokens is None or p.num_tokens <= max_tokens:
      yield p


def _too_few(max_tokens) -> ValueError:
  return ValueError(f"too few distinct problems fit in {max_tokens} response tokens; raise "
                    "rollout.max_new_tokens, or lower task.num_train, num_heldout or lap_median")


def sample_problems(seed: int, count: int, *, max_laps: int, lap_median: float, lap_sigma: float,
                    max_tokens: int | None = None) -> list[Problem]:
  """`count` solvable problems from a seeded generator; laps are log-normal
  (median `lap_median`, shape `lap_sigma`) rounded and capped at `max_laps`,
  and a problem whose response would exceed `max_tokens` is drawn again."""
  draws = _draws(np.random.default_rng(seed), max_laps=max_laps, lap_median=lap_median,
                 lap_sigma=lap_sigma, max_tokens=max_tokens, limit=20 * count + 1000)
  problems = [p for _, p in zip(range(count), draws)]
  if len(problems) < count:
    raise _too_few(max_tokens)
  return problems


def splits(seed: int, num_train: int, num_heldout: int, *, max_laps: int, lap_median: float,
           lap_sigma: float, max_tokens: int) -> tuple[list[Example], list[Example]]:
  """A fixed pool of `num_train` distinct problems and a disjoint held-out set.

  RL revisits the pool epoch after epoch (prompts recur, as in a dataset of
  a few thousand problems); `difficulty` is the response length in tokens.
  """
  need = num_train + num_heldout
  out, seen = [], set()
  for p in _draws(np.random.default_rng(seed), max_laps=max_laps, lap_median=lap_median,
                  lap_sigma=lap_sigma, max_tokens=max_tokens, limit=20 * need + 1000):
    if p not in seen:
      seen.add(p)
      out.append(p)
      if len(out) == need:
        break
  else:
    raise _too_few(max_tokens)
  as_examples = lambda ps: [Example(p.prompt, " ".join(p.solution()), p.num_tokens) for p in ps]
  return as_examples(out[num_heldout:]), as_examples(out[:num_heldout])


def warm_start_examples(seed: int, count: int, exclude: Sequence[str], *, max_laps: int,
                        lap_median: float, lap_sigma: float, max_tokens: int) -> list[Example]:
  """`count` problems for the supervised warm start, drawn fresh from the
  generator (with repeats), none of them a prompt in `exclude` (the
  held-out set). A smaller `lap_median` than the pool's gives many short
  worked solutions: the rule (read the step and target, write markers,
  count down) is learned from examples, and short ones cost a few tokens.
  """
  held = set(exclude)
  draws = _draws(np.random.default_rng(seed), max_laps=max_laps, lap_median=lap_median,
                 lap_sigma=lap_sigma, max_tokens=max_tokens, limit=20 * count + 1000)
  kept = itertools.islice((p for p in draws if p.prompt not in held), count)
  out = [Example(p.prompt, " ".join(p.solution()), p.num_tokens) for p in kept]
  if len(out) < count:
    raise _too_few(max_tokens)
  return out


def parse_problem(prompt: str) -> Problem:
  """Inverse of Problem.prompt."""
  words = prompt.split()
  try:
    if (len(words) != 5 or words[4] != "?" or words[1][0] != "+" or words[2][0] != "="
        or words[3][0] != "x"):
      raise ValueError
    p = Problem(int(words[0]), int(words[1][1:]), int(words[2][1:]), int(words[3][1:]))
  except ValueError:
    raise ValueError(f"not a lap-walk prompt: {prompt!r}") from None
  if not (0 <= p.start < MODULUS and 0 < p.step < MODULUS and 0 <= p.target < MODULUS and p.laps >= 1):
    raise ValueError(f"values of {prompt!r} are out of range")
  return p


def worked_solution(problem: Problem, rng: np.random.Generator, error_rate: float = 0.0) -> str:
  """A response that slips at each value with probability `error_rate`.

  After a slip the walk continues from the wrong value and still writes a
  marker whenever it reaches the target; it stops after `#0`, or after as
  many tokens as the correct response has.
  """
  written, v, remaining = [], problem.start, problem.laps - 1
  while len(written) < problem.num_tokens:
    v = (v + problem.step) % MODULUS
    if error_rate > 0 and rng.random() < error_rate:
      v = (v + int(rng.integers(1, MODULUS))) % MODULUS  # any other value, uniformly
    written.append(str(v))
    if v == problem.target and len(written) < problem.num_tokens:
      written.append(f"#{remaining}")
      if remaining == 0:
        break
      remaining -= 1
  return " ".join(written)


def chain_reward(completion: str, answer: str) -> float:
  """1.0 when the completion is exactly the reference walk `answer`."""
  return float(completion.split() == answer.split())


def final_reward(completion: str, answer: str) -> float:
  """1.0 when the completion ends the countdown at the target, as `answer` does."""
  return float(completion.split()[-2:] == answer.split()[-2:])
