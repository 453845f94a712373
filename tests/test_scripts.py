"""The command-line entry points the README documents, run as a user would."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
  out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def test_bench_rollout_prints_the_documented_json(hf_dir):
  line = _run("scripts/bench_rollout.py", "--hf-checkpoint", hf_dir("qwen2", tie=True), "--batch", "4",
              "--prompt-len", "8", "--new-tokens", "6", "--group-size", "2").strip().splitlines()[-1]
  rec = json.loads(line)
  assert rec["batch"] == 4 and rec["new_tokens"] == 6 and rec["decode_steps"] == 6
  # The rate is the tokens actually generated (4 rows x 6) over the timed call.
  assert rec["tokens_per_s"] * rec["seconds"] == pytest.approx(4 * 6)
  assert rec["compile_s"] > 0 and rec["load_s"] > 0
  assert rec["peak_rss_mb"] > 100  # this process holds JAX and the model: megabytes, not bytes
  assert rec["engine"] == "jaxroll" and rec["backend"] == "cpu"


def test_bench_cache_length_times_steps_per_cache_length(hf_dir):
  folder = hf_dir("qwen2", tie=True)
  rec = json.loads(_run("scripts/bench_cache_length.py", "--hf-checkpoint", folder, "--batch", "2",
                        "--prompt-len", "8", "--new-tokens", "8,4", "--steps", "4", "--reps", "2")
                   .strip().splitlines()[-1])
  with open(os.path.join(folder, "config.json")) as f:
    c = json.load(f)
  head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
  # Keys and values, every layer, every row, float32: from the config, not the engine.
  assert rec["kv_bytes_per_position"] == 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4 * 2
  assert rec["cache_lengths"] == [12, 16] and rec["steps"] == 4
  assert len(rec["step_ms"]) == 2 and min(rec["step_ms"]) > 0
  # The line through the two medians.
  slope = (rec["step_ms"][1] - rec["step_ms"][0]) / 4 * 1e3
  assert rec["slope_us_per_position"] == pytest.approx(slope, rel=1e-6, abs=1e-9)


def test_bench_cache_length_rejects_too_few_tokens_in_one_line(hf_dir):
  out = subprocess.run([sys.executable, "scripts/bench_cache_length.py", "--hf-checkpoint",
                        hf_dir("qwen2", tie=True), "--batch", "2", "--prompt-len", "8", "--new-tokens", "8,16"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 2
  assert "each >= --steps (32)" in out.stderr.strip().splitlines()[-1]


def test_profile_decode_splits_the_step_by_function(hf_dir):
  rec = json.loads(_run("scripts/profile_decode.py", "--hf-checkpoint", hf_dir("qwen2", tie=True), "--batch", "2",
                        "--prompt-len", "4", "--new-tokens", "5", "--top", "3").strip().splitlines()[-1])
  assert rec["decode_steps"] == 5 and rec["step_us"] > 0
  share = {name: s for name, _, s in rec["functions"]}
  assert share["decode.py:generate"] > 0.9
  assert 0 < share["transformer.py:MLP.__call__"] <= share["transformer.py:Block.__call__"]


def test_profile_decode_rejects_a_folder_without_a_checkpoint(tmp_path):
  out = subprocess.run([sys.executable, "scripts/profile_decode.py", "--hf-checkpoint", str(tmp_path),
                        "--batch", "2", "--prompt-len", "4", "--new-tokens", "5"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 2
  assert "holds no config.json" in out.stderr.strip().splitlines()[-1]


def test_bench_rollout_sets_the_decode_step_against_its_weight_stream_probe(hf_dir):
  from jaxroll.model import safetensors_io

  folder = hf_dir("qwen2", tie=True)
  line = _run("scripts/bench_rollout.py", "--hf-checkpoint", folder, "--batch", "4",
              "--prompt-len", "8", "--new-tokens", "6", "--peak-gbps", "100").strip().splitlines()[-1]
  rec = json.loads(line)
  # A tied model's step reads every float32 tensor of the file once (the
  # embedding as the [E, V] head; the rows it gathers are not counted).
  f = safetensors_io.SafetensorsFile(os.path.join(folder, "model.safetensors"))
  assert rec["weight_bytes"] == sum(4 * int(np.prod(f.info(n)[1])) for n in f.names())
  assert rec["probe_gbps"] == max(rec["probe_xla_gbps"], rec["probe_numpy_gbps"])
  assert rec["probe_xla_gbps"] == pytest.approx(rec["weight_bytes"] / rec["probe_xla_s"] / 1e9)
  assert rec["step_gbps"] == pytest.approx(rec["weight_bytes"] / rec["step_s"] / 1e9)
  assert rec["weight_stream_fraction"] == pytest.approx(rec["step_gbps"] / rec["probe_gbps"])
  assert rec["step_matmul_s"] + rec["step_other_s"] == pytest.approx(rec["step_s"])
  assert rec["roofline_fraction"] == pytest.approx(rec["step_gbps"] / 100)
  # At probe speeds: the layers' matmuls (every [out, in] tensor of a layer; not
  # the head) over the 4 prompts' 8 positions, then one weight read a step.
  layer_params = sum(int(np.prod(f.info(n)[1])) for n in f.names()
                     if n.startswith("model.layers.") and n.endswith("proj.weight"))
  assert rec["prefill_flops"] == 2 * 4 * 8 * layer_params
  assert rec["prefill_matmul_gflops"] == pytest.approx(rec["prefill_flops"] / rec["prefill_matmul_s"] / 1e9)
  assert rec["probe_run_s"] == pytest.approx(
      rec["prefill_matmul_s"] + rec["decode_steps"] * rec["weight_bytes"] / rec["probe_gbps"] / 1e9)
  assert rec["probe_run_tokens_per_s"] == pytest.approx(4 * 6 / rec["probe_run_s"])
  assert rec["prefill_s"] > 0
  assert 0 < rec["step_s"] < rec["seconds"]
  # The int8 chain reads a byte per element of every matrix (the 2-D tensors).
  assert rec["int8_weight_bytes"] == sum(int(np.prod(f.info(n)[1])) for n in f.names() if len(f.info(n)[1]) == 2)
  assert rec["probe_int8_gbps"] == pytest.approx(rec["int8_weight_bytes"] / rec["probe_int8_s"] / 1e9)


def test_gpu_kernel_check_passes_in_interpret_mode():
  """The GPU run's kernel check (scripts/gpu_kernels.py) at small shapes on
  CPU: every kernel against its reference, one JSON record each."""
  out = _run("scripts/gpu_kernels.py", "--small", "--interpret", "--reps", "1", "--dtype", "float32")
  records = json.loads(out.strip().splitlines()[-1])
  assert [r["kernel"] for r in records] == ["paged_attention", "quest_scores", "spec_verify",
                                            "spec_verify_sampled"]
  assert all(r["ok"] and r["interpret"] for r in records), records
  assert records[2]["identical_tokens"] and records[3]["identical_tokens"]


def test_sample_decodes_text_from_a_checkpoint_with_tokenizer(hf_dir, tmp_path):
  import shutil

  import tokenizers

  folder = str(tmp_path / "ckpt")
  shutil.copytree(hf_dir("qwen2", tie=True), folder)
  vocab = {f"w{i}": i for i in range(97)}
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  backend.save(os.path.join(folder, "tokenizer.json"))
  out = _run("scripts/sample.py", "--hf-checkpoint", folder, "--prompt", "w5 w6 w7",
             "--group-size", "2", "--max-new-tokens", "5", "--slots", "2")
  assert out.count("--- prompt 0 sample") == 2
  assert json.loads(out.strip().splitlines()[-1])["rows"] == 2


def test_sample_runs_the_builtin_policy():
  rec = json.loads(_run("scripts/sample.py", "--num-prompts", "2", "--group-size", "2",
                        "--max-new-tokens", "8").strip().splitlines()[-1])
  assert rec["rows"] == 4 and 4 <= rec["tokens"] <= 32


def test_launch_scripts_dry_run_print_the_commands():
  out = _run("scripts/launch_slurm.py", "--nodes", "2", "--partition", "gpu", "--config",
             "configs/default.py", "--set", "mesh.fsdp=-1", "--dry-run")
  assert "#SBATCH --nodes=2" in out and "JAXROLL_NUM_PROCESSES=2" in out
  assert "JAXROLL_PROCESS_ID=$SLURM_PROCID exec jaxroll train configs/default.py --set mesh.fsdp=-1" in out
  out = _run("scripts/launch_tpu_pod.py", "--tpu", "pod", "--zone", "z", "--config",
             "configs/default.py", "--dry-run")
  assert out.startswith("gcloud compute tpus tpu-vm ssh pod --zone=z --worker=all")
  assert "JAXROLL_DISTRIBUTED=auto jaxroll train configs/default.py" in out


def test_bench_live_rows_decodes_the_same_tokens_every_way():
  """A short run prints its JSON; the three engines decode the same tokens."""
  line = _run("scripts/bench_live_rows.py", "--warm-steps", "2", "--reps", "1",
              "--max-new-tokens", "32").strip().splitlines()[-1]
  rec = json.loads(line)
  assert rec["speedup"] > 0 and 0 < rec["live_fraction"] <= 1 and rec["decode_steps"] <= 32
  assert rec["tokens"] > 0 and rec["rows_differing"] == 0


def test_bench_workload_measures_the_run_it_launches(tmp_path):
  """A pool of 16 prompts at 16 prompts per step: every prompt is sampled
  in every one of the 3 steps, which pins pool_revisits; the length
  statistics are recomputed from the run's own trace."""
  import numpy as np

  out = _run("scripts/bench_workload.py", "--out-dir", str(tmp_path), "--set", "steps=3",
             "--set", "eval_every=3", "--set", "warm_start.steps=20", "--set", "task.num_train=16",
             "--set", "task.num_heldout=16", "--set", "rollout.max_new_tokens=64", "--set", "report=false",
             "--set", "tensorboard=false")
  rec = json.loads(out.strip().splitlines()[-1])
  for key in ("len_mean", "len_cv", "len_p99_over_median", "max_new_tokens", "pool_revisits",
              "frac_all_wrong_first", "frac_all_right_last", "heldout_gain", "main_job_s",
              "rollout_share"):
    assert key in rec, key
  assert rec["pool_revisits"] == rec["pool_revisits_min"] == 3 and rec["rl_steps"] == 3
  run = tmp_path / "workload"
  first = np.array(json.loads((run / "lengths.jsonl").read_text().splitlines()[0])["lengths"], float)
  assert rec["len_mean"] == pytest.approx(first.mean(), rel=1e-3)
  assert rec["len_p99_over_median"] == pytest.approx(np.percentile(first, 99) / np.median(first), rel=1e-3)
  assert rec["max_new_tokens"] == 64 and 0 < rec["rollout_share"] < 1
  assert "| pool_revisits | 3.000 | >= 4 | NO |" in out  # each target is checked, not assumed
