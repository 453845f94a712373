"""Built-in task, tokenizer, QA-file loader and the reward runner."""

import json
import time

import numpy as np
import pytest
from scipy import stats

from jaxroll.tasks import RewardRunner, mod_walk
from jaxroll.tasks.math_files import DatasetError, load_qa_file, math_verify_reward
from jaxroll.tasks.word_tokenizer import WordTokenizer


def brute_force_walk(start, step, target, M=mod_walk.MODULUS):
  values, v = [], start
  for _ in range(M):
    v = (v + step) % M
    values.append(v)
    if v == target:
      return values
  return None


def test_problems_are_seeded_solvable_and_match_brute_force():
  a = mod_walk.sample_problems(3, 200)
  assert a == mod_walk.sample_problems(3, 200)
  assert a != mod_walk.sample_problems(4, 200)
  for p in a:
    assert p.walk() == brute_force_walk(p.start, p.step, p.target)
    assert mod_walk.parse_problem(p.prompt) == p


def test_heldout_is_disjoint_from_train():
  train, heldout = mod_walk.splits(0, 5000, 128)
  assert len(heldout) == 128 and len({e.prompt for e in heldout}) == 128
  assert not {e.prompt for e in heldout} & {e.prompt for e in train}


def test_distinct_problem_count_matches_what_sampling_finds():
  # Enumeration, checked against the sampler: 40,000 draws of the 1,660
  # problems of at most 5 steps miss any one with probability ~e^-24.
  assert len(set(mod_walk.sample_problems(3, 40_000, 5))) == mod_walk.num_distinct_problems(5)
  with pytest.raises(ValueError, match="only 1660 distinct problems"):
    mod_walk.splits(0, 10, 1661, 5)


def test_workload_has_length_and_difficulty_spread():
  train, _ = mod_walk.splits(0, 5000, 128)
  lengths = np.array([e.difficulty + 1 for e in train])  # values + the stop token
  assert lengths.std() / lengths.mean() >= 0.3
  assert lengths.min() == 2 and lengths.max() == mod_walk.MODULUS


def test_reward_accepts_only_the_exact_walk():
  p = mod_walk.Problem(5, 3, 14)
  answer = " ".join(map(str, p.walk()))
  assert answer == "8 11 14"
  assert mod_walk.reward("8 11 14", answer) == 1.0
  assert mod_walk.reward("8 12 14", answer) == 0.0  # a wrong step
  assert mod_walk.reward("8 11", answer) == 0.0  # stopped early
  assert mod_walk.reward("8 11 14 17", answer) == 0.0  # ran past the target
  assert mod_walk.reward("", answer) == 0.0


def test_worked_solution_slips_at_the_configured_rate():
  """Per-step slip frequency against a binomial test (fixed seed)."""
  rng = np.random.default_rng(0)
  problems = mod_walk.sample_problems(1, 400)
  slips = steps = 0
  for p in problems:
    written = [int(x) for x in mod_walk.worked_solution(p, rng, 0.2).split()]
    prev = p.start
    for v in written:
      slips += v != (prev + p.step) % mod_walk.MODULUS
      steps += 1
      prev = v
  assert stats.binomtest(slips, steps, 0.2).pvalue > 1e-3
  clean = mod_walk.worked_solution(problems[0], rng, 0.0)
  assert mod_walk.reward(clean, " ".join(map(str, problems[0].walk()))) == 1.0


def test_parse_problem_rejects_malformed_prompts():
  for bad in ["5 +3 =2", "5 +0 =2 ?", "5 3 =2 ?", "25 +3 =2 ?"]:
    with pytest.raises(ValueError):
      mod_walk.parse_problem(bad)


def test_word_tokenizer_round_trip_and_unknown_word():
  tok = mod_walk.tokenizer()
  text = "5 +3 =14 ?"
  ids = tok.encode(text)
  assert ids[0] == tok.bos_token_id and tok.decode(ids) == text
  assert tok.decode(ids + list(tok.eos_token_ids)) == text
  with pytest.raises(ValueError, match="'x7'"):
    tok.encode("5 x7")
  with pytest.raises(ValueError, match="repeated"):
    WordTokenizer(["a", "a"])


# -- QA files ------------------------------------------------------------------

def _write_jsonl(path, lines):
  path.write_text("\n".join(lines) + "\n")
  return str(path)


GOOD = [json.dumps({"question": "1+1?", "answer": "It is 2.\n#### 2"}),
        json.dumps({"question": "2*3?", "answer": "6"})]


def test_qa_file_reads_gsm8k_answers_and_template(tmp_path):
  path = _write_jsonl(tmp_path / "d.jsonl", GOOD)
  ex = load_qa_file(path, prompt_template="Q: {question}\nA:")
  assert [e.prompt for e in ex] == ["Q: 1+1?\nA:", "Q: 2*3?\nA:"]
  assert [e.answer for e in ex] == ["2", "6"]


def test_qa_file_bad_line_error_names_the_line(tmp_path):
  path = _write_jsonl(tmp_path / "d.jsonl", [GOOD[0], "{not json", GOOD[1]])
  with pytest.raises(DatasetError, match=r"d.jsonl:2: invalid JSON"):
    load_qa_file(path)


def test_qa_file_skip_mode_counts_what_it_skips(tmp_path):
  lines = [GOOD[0], "{not json", json.dumps({"question": "no answer"}), "[1, 2]", GOOD[1]]
  path = _write_jsonl(tmp_path / "d.jsonl", lines)
  stats_ = {}
  ex = load_qa_file(path, on_bad_line="skip", stats=stats_)
  assert len(ex) == 2 and stats_ == {"skipped_lines": 3, "rows": 5}


def test_qa_file_parquet(tmp_path):
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq

  path = str(tmp_path / "d.parquet")
  pq.write_table(pa.table({"question": ["1+1?"], "answer": ["#### 2"]}), path)
  assert load_qa_file(path)[0].answer == "2"


def test_math_verify_reward():
  assert math_verify_reward("so the answer is \\boxed{18}.", "18") == 1.0
  assert math_verify_reward("The answer is \\boxed{0.5}", "1/2") == 1.0
  assert math_verify_reward("\\boxed{17}", "18") == 0.0
  assert math_verify_reward("no number at all", "18") == 0.0


# -- the reward runner -----------------------------------------------------------

def test_reward_runner_scores_failures_zero_and_counts_them():
  def fn(completion, answer):
    if completion == "raise":
      raise RuntimeError("verifier crashed")
    if completion == "hang":
      time.sleep(2.0)
    if completion == "nan":
      return float("nan")
    return float(completion == answer)

  runner = RewardRunner(fn, timeout_s=0.3, num_workers=2)
  t0 = time.monotonic()
  report = runner.score(["hang", "hang", "a", "raise", "nan", "b", "a"], ["a"] * 7)
  assert time.monotonic() - t0 < 1.5  # two stuck workers do not starve the rest
  assert report.rewards == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
  assert report.num_timeouts == 2 and report.num_errors == 2
  # The runner keeps working after abandoning stuck calls.
  assert runner.score(["a"], ["a"]).rewards == [1.0]
