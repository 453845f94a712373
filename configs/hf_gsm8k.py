"""GRPO on a GSM8K-style JSONL file from a local Hugging Face checkpoint.

  jaxroll train configs/hf_gsm8k.py \
      --set policy.hf_checkpoint=/models/Qwen2.5-0.5B-Instruct \
      --set task.train_file=/data/gsm8k/train.jsonl \
      --set task.heldout_file=/data/gsm8k/test.jsonl

The folder holds config.json, *.safetensors and tokenizer.json (Llama or
Qwen2 architecture); each JSONL line has "question" and "answer" (GSM8K's
"#### <number>" suffix is the reference). Rewards come from math-verify.
Sized for one accelerator with bf16 compute (a 0.5B model: a GPU or TPU
host; on CPU expect minutes per step). Not run in CI.
"""

from jaxroll.config import (ExperimentConfig, PolicyConfig, RLConfig, RolloutConfig,
                            TaskConfig, WarmStartConfig)


def get_config() -> ExperimentConfig:
  return ExperimentConfig(
      run_dir="runs/hf_gsm8k",
      steps=200,
      eval_every=20,
      eval_samples=1,
      checkpoint_every=10,
      task=TaskConfig(
          name="qa_file", train_file="gsm8k/train.jsonl", heldout_file="gsm8k/test.jsonl",
          num_train=7473, num_heldout=256, on_bad_line="skip",
          prompt_template=("Solve the problem. Put the final answer in \\boxed{{}}.\n"
                           "Problem: {question}\nSolution:"),
          reward_timeout_s=10.0),
      policy=PolicyConfig(hf_checkpoint="", param_dtype="float32", dtype="bfloat16"),
      warm_start=WarmStartConfig(steps=0),
      rollout=RolloutConfig(prompts_per_step=32, group_size=8, max_prompt_len=384,
                            max_new_tokens=512, num_slots=256, temperature=1.0),
      rl=RLConfig(advantage="grpo", aggregation="token_mean", learning_rate=1e-6,
                  warmup_steps=10, end_lr_ratio=1.0, kl_coef=0.0, max_grad_norm=1.0,
                  weight_decay=0.01,
                  # Update chunks big enough to keep an accelerator busy
                  # (float32 logits over 152k tokens are 2.5 GB at 4096).
                  microbatch_tokens=4096),
  )
