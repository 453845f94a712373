"""A training run on a GSM8K-style JSONL file with a Hugging Face checkpoint (the hf_gsm8k path)."""

import json
import os
import shutil

import pytest

from jaxroll import config as config_lib
from jaxroll.tasks.math_files import DatasetError
from jaxroll.train import train

pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _checkpoint_with_tokenizer(hf_dir, folder):
  import tokenizers

  shutil.copytree(hf_dir("qwen2", tie=True), folder)
  words = ["<unk>", "<s>", "</s>"] + [str(i) for i in range(10)] + ["Q:", "A:", "+", "=", "?"]
  vocab = {w: i for i, w in enumerate(words)}
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  backend.save(os.path.join(folder, "tokenizer.json"))
  return folder


def _config(tmp_path, ckpt, data, *extra):
  over = config_lib.load(f"{ROOT}/configs/hf_gsm8k.py")
  return config_lib.apply_overrides(over, [
      f"run_dir={tmp_path / 'run'}", f"policy.hf_checkpoint={ckpt}", f"task.train_file={data}",
      f"task.heldout_file={data}", "task.num_heldout=2", "task.prompt_template=Q: {question} A:",
      "policy.dtype=float32", "steps=2", "eval_every=2", "eval_samples=2", "progress=false",
      "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_prompt_len=16",
      "rollout.max_new_tokens=4", "rollout.num_slots=4", "rl.learning_rate=1e-3", *extra])


def test_qa_file_run_trains_and_counts_skipped_lines(hf_dir, tmp_path):
  ckpt = _checkpoint_with_tokenizer(hf_dir, str(tmp_path / "ckpt"))
  data = tmp_path / "train.jsonl"
  rows = [{"question": "1 + 2 = ?", "answer": "#### 3"}, {"question": "4 + 4 = ?", "answer": "8"},
          {"question": "2 + 5 = ?", "answer": "x\n#### 7"}]
  data.write_text("\n".join([json.dumps(rows[0]), "{broken", json.dumps(rows[1]),
                             json.dumps(rows[2])]) + "\n")
  with pytest.raises(DatasetError, match="train.jsonl:2"):
    train(_config(tmp_path, ckpt, data, "task.on_bad_line=error"))
  result = train(_config(tmp_path, ckpt, data))  # the shipped config skips bad lines
  with open(tmp_path / "run" / "run_info.json") as f:
    info = json.load(f)
  assert info["data"]["train_skipped_lines"] == 1 and info["data"]["train_rows"] == 3
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    metrics = [json.loads(x) for x in f]
  assert [m["step"] for m in metrics] == [0, 1, 2]
  assert metrics[-1]["cumulative_rollouts"] == 8 and result["final_accuracy"] is not None
