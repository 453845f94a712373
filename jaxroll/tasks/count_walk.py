"""Counted walk: the modular walk for a heavy-tailed number of steps, each
value followed by the number of steps still to go.

The reasoning-shaped built-in task: long chains of written steps whose
length varies by more than an order of magnitude between problems, each
step checkable. One word per token:

  prompt    5 #7 8 #6          (the walk's first two values, each followed
                                by the values still to come)
  solution  11 #5 14 #4 17 #3 0 #2 3 #1 6 #0

The prompt fixes the start (5) and the step (8 - 5 = 3 modulo 20) and the
number of steps left (6). Each value of the response is the previous one
plus the step modulo 20, each counter `#r` is the previous counter minus
one, and the response stops after `#0`; its answer is the last value.
Every token depends on the token two places back and the prompt's step
(a value on the previous value, a counter on the previous counter), and
the counters make the stopping point local: nothing
needs a count over the whole response, because the response writes its
own. That is what lets a 2-layer policy trained from scratch learn the
rule in minutes (a walk whose laps were counted only at the target, with
no counter per value, was not learned at this size).

The walk repeats with a period of at most 20 values, so after the first
period a value can also be copied from one period back; what makes a
response right is the first period's arithmetic and no slip afterwards.
The warm start therefore trains mostly on short walks, where the
arithmetic is most of the loss, with a long tail that teaches the
counters.

Lengths: a problem of n steps has a 2n-token response. n is drawn from a
log-normal (median `median`, shape `sigma`) and drawn again when the
response would not fit the token budget, so response lengths are
long-tailed: a few problems take ten times the median (survey Section 3:
long chains of very uneven length).

Rewards (both exact): "chain" is 1 when the response is exactly the
reference walk; "final" is 1 when it ends with the reference's last value
and `#0`, however it got there.

The warm start trains on `worked_solution(..., error_rate)`: each value
slips to a wrong one with probability `error_rate` and the walk goes on
from it (counters never slip, so the length stays right). The supervised
policy then slips at about that rate per value: long problems are nearly
always wrong and short ones mostly right, and RL has to drive the slip
rate down, which it can only learn from the reward.
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


@dataclasses.dataclass(frozen=True)
class Problem:
  start: int
  step: int
  steps: int

  @property
  def prompt(self) -> str:
    return f"{self.start} #{self.steps + 1} {self.value(1)} #{self.steps}"

  def value(self, i: int) -> int:
    """The walk's i-th value (the start is the 0th)."""
    return (self.start + i * self.step) % MODULUS

  def solution(self) -> list[str]:
    """The words of the correct response."""
    out = []
    for i in range(1, self.steps + 1):
      out += [str(self.value(i + 1)), f"#{self.steps - i}"]
    return out

  @property
  def num_tokens(self) -> int:
    return 2 * self.steps


def max_steps(max_tokens: int) -> int:
  """The longest walk whose response fits `max_tokens` tokens."""
  return max_tokens // 2


def tokenizer(max_steps: int) -> WordTokenizer:
  words = [str(v) for v in range(MODULUS)] + [f"+{s}" for s in range(1, MODULUS)]
  words += [f"#{r}" for r in range(max_steps + 2)]  # the prompt's first counter is steps + 1
  return WordTokenizer(words)


def _draws(rng: np.random.Generator, *, median: float, sigma: float, max_tokens: int, limit: int):
  """Problems whose response fits `max_tokens`, drawn one by one; at most `limit` draws."""
  for _ in range(limit):
    start, step = int(rng.integers(0, MODULUS)), int(rng.integers(1, MODULUS))
    n = max(1, round(median * math.exp(sigma * rng.standard_normal())))
    if 2 * n <= max_tokens:
      yield Problem(start, step, n)


def _too_few(max_tokens) -> ValueError:
  return ValueError(f"too few distinct problems fit in {max_tokens} response tokens; raise "
                    "rollout.max_new_tokens, or lower task.num_train, num_heldout or walk_median")


def _examples(problems) -> list[Example]:
  return [Example(p.prompt, " ".join(p.solution()), p.num_tokens) for p in problems]


def sample_problems(seed: int, count: int, *, median: float, sigma: float,
                    max_tokens: int) -> list[Problem]:
  """`count` problems from a seeded generator (repeats possible)."""
  draws = _draws(np.random.default_rng(seed), median=median, sigma=sigma, max_tokens=max_tokens,
                 limit=20 * count + 1000)
  problems = list(itertools.islice(draws, count))
  if len(problems) < count:
    raise _too_few(max_tokens)
  return problems


def splits(seed: int, num_train: int, num_heldout: int, *, median: float, sigma: float,
           max_tokens: int) -> tuple[list[Example], list[Example]]:
  """A fixed pool of `num_train` distinct problems and a disjoint held-out set.

  RL revisits the pool epoch after epoch (prompts recur, as in a dataset of
  a few thousand problems); `difficulty` is the response length in tokens.
  """
  need = num_train + num_heldout
  out, seen = [], set()
  for p in _draws(np.random.default_rng(seed), median=median, sigma=sigma, max_tokens=max_tokens,
                  limit=20 * need + 1000):
    if p not in seen:
      seen.add(p)
      out.append(p)
      if len(out) == need:
        break
  else:
    raise _too_few(max_tokens)
  return _examples(out[num_heldout:]), _examples(out[:num_heldout])


def warm_start_examples(seed: int, count: int, exclude: Sequence[str], *, median: float,
                        sigma: float, max_tokens: int) -> list[Example]:
  """`count` problems for the supervised warm start, drawn fresh from the
  generator (with repeats), none of them a prompt in `exclude` (the
  held-out set). Fresh problems teach the rule rather than the pool's
  answers; a smaller `median` than the pool's makes them cheaper.
  """
  held = set(exclude)
  draws = _draws(np.random.default_rng(seed), median=median, sigma=sigma, max_tokens=max_tokens,
                 limit=20 * count + 1000)
  out = _examples(itertools.islice((p for p in draws if p.prompt not in held), count))
  if len(out) < count:
    raise _too_few(max_tokens)
  return out


def parse_problem(prompt: str) -> Problem:
  """Inverse of Problem.prompt."""
  words = prompt.split()
  try:
    if len(words) != 4 or words[1][0] != "#" or words[3][0] != "#":
      raise ValueError
    start, first, steps = int(words[0]), int(words[2]), int(words[3][1:])
  except ValueError:
    raise ValueError(f"not a counted-walk prompt: {prompt!r}") from None
  p = Problem(start, (first - start) % MODULUS, steps)
  if not (0 <= start < MODULUS and 0 <= first < MODULUS and p.step and steps >= 1
          and words[1] == f"#{steps + 1}"):
    raise ValueError(f"values of {prompt!r} are out of range or inconsistent")
  return p


def worked_solution(problem: Problem, rng: np.random.Generator, error_rate: float = 0.0) -> str:
  """A response whose values slip with probability `error_rate` each.

  After a slip the walk continues from the wrong value; the counters are
  always right, so the response has the reference's length.
  """
  written, v = [], problem.value(1)
  for remaining in range(problem.steps - 1, -1, -1):
    v = (v + problem.step) % MODULUS
    if error_rate > 0 and rng.random() < error_rate:
      v = (v + int(rng.integers(1, MODULUS))) % MODULUS  # any other value, uniformly
    written += [str(v), f"#{remaining}"]
  return " ".join(written)


# 1.0 when the completion is exactly the reference walk (word for word).
chain_reward = mod_walk.reward


def final_reward(completion: str, answer: str) -> float:
  """1.0 when the completion ends with the reference's last value and `#0`."""
  return float(completion.split()[-2:] == answer.split()[-2:])
