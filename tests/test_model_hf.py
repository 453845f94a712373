"""jaxroll's decoder against transformers' PyTorch implementation on the same weights."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_fixtures  # noqa: E402
from jaxroll.model.hf_import import CheckpointError, load_hf_model  # noqa: E402


def _logits_pair(folder, tokens_BxT):
  model = load_hf_model(folder)
  B, T = tokens_BxT.shape
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  ours, _ = model(jnp.asarray(tokens_BxT, jnp.int32), positions)
  with torch.no_grad():
    theirs = hf_fixtures.load_torch_model(folder)(torch.tensor(tokens_BxT)).logits.numpy()
  return np.asarray(ours), theirs


@pytest.mark.parametrize("arch,tie", [("qwen2", True), ("qwen2", False), ("llama", False),
                                      ("llama", True), ("llama3", False)])
def test_full_sequence_logits_match_transformers(hf_dir, arch, tie):
  folder = hf_dir(arch, tie=tie)
  tokens = np.random.default_rng(0).integers(0, 97, size=(3, 40))
  ours, theirs = _logits_pair(folder, tokens)
  assert ours.shape == theirs.shape == (3, 40, 97)
  assert np.abs(ours - theirs).max() < 1e-4


def test_sharded_checkpoint_loads_and_matches(hf_dir, tmp_path):
  folder = hf_fixtures.save_random_hf_model(str(tmp_path / "sharded"), "qwen2", max_shard_size="40KB")
  assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
  tokens = np.random.default_rng(1).integers(0, 97, size=(2, 16))
  ours, theirs = _logits_pair(folder, tokens)
  assert np.abs(ours - theirs).max() < 1e-4


def test_missing_shard_is_named(tmp_path):
  folder = hf_fixtures.save_random_hf_model(str(tmp_path / "sharded"), "llama", max_shard_size="40KB")
  with open(os.path.join(folder, "model.safetensors.index.json")) as f:
    weight_map = json.load(f)["weight_map"]
  victim = sorted(set(weight_map.values()))[-1]
  os.remove(os.path.join(folder, victim))
  with pytest.raises(CheckpointError, match=victim):
    load_hf_model(folder)


def test_unknown_architecture_is_rejected(hf_dir, tmp_path):
  folder = str(tmp_path / "gpt")
  shutil.copytree(hf_dir("llama"), folder)
  with open(os.path.join(folder, "config.json")) as f:
    cfg = json.load(f)
  cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(cfg, f)
  with pytest.raises(ValueError, match="GPT2LMHeadModel"):
    load_hf_model(folder)


def test_missing_tensor_is_named_never_partial(hf_dir, tmp_path):
  from jaxroll.model import safetensors_io

  folder = str(tmp_path / "holes")
  shutil.copytree(hf_dir("qwen2"), folder)
  path = os.path.join(folder, "model.safetensors")
  tensors = {k: np.array(v) for k, v in safetensors_io.load(path).items()}
  del tensors["model.layers.1.self_attn.k_proj.bias"]
  safetensors_io.save(path, tensors)
  with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
    load_hf_model(folder)


def test_extra_layer_tensors_are_not_silently_dropped(hf_dir, tmp_path):
  folder = str(tmp_path / "extra")
  shutil.copytree(hf_dir("llama"), folder)
  with open(os.path.join(folder, "config.json")) as f:
    cfg = json.load(f)
  cfg["num_hidden_layers"] = 1  # the file still holds layer 1
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(cfg, f)
  with pytest.raises(CheckpointError, match=r"model\.layers\.1\."):
    load_hf_model(folder)


def test_bfloat16_params_stay_close(hf_dir):
  folder = hf_dir("qwen2", tie=True)
  model = load_hf_model(folder, param_dtype="bfloat16", dtype="bfloat16")
  assert model.embed.embedding[...].dtype == jnp.bfloat16
  tokens = np.random.default_rng(2).integers(0, 97, size=(2, 12))
  pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
  ours, _ = model(jnp.asarray(tokens, jnp.int32), pos)
  with torch.no_grad():
    theirs = hf_fixtures.load_torch_model(folder)(torch.tensor(tokens)).logits.numpy()
  assert np.abs(np.asarray(ours) - theirs).max() < 0.05


def test_tokenizer_loads_from_folder(tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  from jaxroll.model.tokenizer import Tokenizer

  vocab = {"[UNK]": 0, "<eos>": 1, "1": 2, "+": 3, "=": 4, "2": 5}
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  backend.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
  tok = Tokenizer.from_folder(str(tmp_path))
  assert tok.encode("1 + 1 = 2") == [2, 3, 2, 4, 5]
  assert tok.decode([2, 3, 2]) == "1 + 1"
  assert tok.eos_token_ids == (1,)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_generation_matches_transformers(hf_dir, arch):
  import jax

  from jaxroll.rollout import RolloutEngine, SamplingParams

  folder = hf_dir(arch, tie=arch == "qwen2")
  model = load_hf_model(folder)
  engine = RolloutEngine.for_model(model, num_slots=4, max_prompt_len=16, max_new_tokens=20,
                                   sampling=SamplingParams(temperature=0.0))
  prompts = np.random.default_rng(5).integers(3, 97, size=(3, 9))
  traj = engine.rollout(engine.load(model), prompts.tolist(), key=jax.random.key(0))
  with torch.no_grad():
    ref = hf_fixtures.load_torch_model(folder).generate(
        torch.tensor(prompts), do_sample=False, max_new_tokens=20, min_new_tokens=20,
        attention_mask=torch.ones(prompts.shape, dtype=torch.long), pad_token_id=0)
  np.testing.assert_array_equal(traj.tokens_NxL, ref[:, 9:].numpy())


@pytest.mark.parametrize("tie", [True, False])
def test_decode_layout_load_samples_what_the_model_samples(hf_dir, tie):
  """Loading straight into decode layout (a tied embedding held once, as
  the [E, V] head) gives the same tokens and log-probs as the model."""
  import jax

  from jaxroll.model.hf_import import load_hf_decode_weights
  from jaxroll.rollout import RolloutEngine, SamplingParams

  folder = hf_dir("qwen2", tie=tie)
  model = load_hf_model(folder)
  cfg, graphdef, state, head_ExV = load_hf_decode_weights(folder)
  assert (head_ExV is not None) == tie
  assert state["embed"]["embedding"].shape[0] == (0 if tie else cfg.vocab_size)
  kw = dict(num_slots=4, max_prompt_len=16, max_new_tokens=12, sampling=SamplingParams(temperature=1.0))
  prompts = np.random.default_rng(3).integers(3, 97, size=(3, 7)).tolist()
  ref_engine = RolloutEngine.for_model(model, **kw)
  ref = ref_engine.rollout(ref_engine.load(model), prompts, group_size=2, key=jax.random.key(4))
  engine = RolloutEngine(cfg, graphdef, **kw)
  params = engine.load(state, head_ExV=head_ExV)
  assert params.embed_from_head == tie
  got = engine.rollout(params, prompts, group_size=2, key=jax.random.key(4))
  np.testing.assert_array_equal(got.tokens_NxL, ref.tokens_NxL)
  np.testing.assert_array_equal(got.length_N, ref.length_N)
  np.testing.assert_allclose(got.logp_NxL, ref.logp_NxL, atol=1e-6)


@pytest.mark.parametrize("tie", [True, False])
def test_engine_compiles_ahead_of_its_weights(hf_dir, tie):
  """The shapes read from the config alone are those of the decode-layout
  load, and an engine compiled ahead from them does not compile its decode
  loop or prefill again when the real weights come (two fewer backend
  compilations in the first rollout than an engine that did not)."""
  import jax
  import jax.monitoring
  from flax import nnx

  from jaxroll.model.hf_import import hf_decode_weight_shapes, load_hf_decode_weights
  from jaxroll.rollout import RolloutEngine, SamplingParams

  folder = hf_dir("qwen2", tie=tie)
  cfg, graphdef, state, head_ExV = load_hf_decode_weights(folder)
  s_cfg, s_graphdef, s_state, s_head = hf_decode_weight_shapes(folder)
  assert (s_cfg, s_graphdef) == (cfg, graphdef)
  as_shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), nnx.to_pure_dict(tree))
  assert as_shapes(s_state) == as_shapes(state)
  assert (s_head is None) == (head_ExV is None)
  if tie:
    assert (s_head.shape, s_head.dtype) == (head_ExV.shape, head_ExV.dtype)
  compiles = []
  def on_event(event, secs, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(event)
  kw = dict(num_slots=4, max_prompt_len=16, max_new_tokens=12, sampling=SamplingParams(temperature=1.0))
  prompts = np.random.default_rng(3).integers(3, 97, size=(4, 16)).tolist()
  counts, tokens = [], []
  jax.monitoring.register_event_duration_secs_listener(on_event)
  try:
    # The first engine also compiles what every engine shares (jitted
    # module-level functions); the next two differ only in compiling ahead.
    for ahead in (False, False, True):
      engine = RolloutEngine(cfg, graphdef, **kw)
      if ahead:
        engine.compile_ahead(s_state, s_head)
      params = engine.load(state, head_ExV=head_ExV)
      compiles.clear()
      tokens.append(engine.rollout(params, prompts, key=jax.random.key(4)).tokens_NxL)
      counts.append(len(compiles))
  finally:
    jax.monitoring.unregister_event_duration_listener(on_event)
  assert counts[2] == counts[1] - 2, counts
  np.testing.assert_array_equal(tokens[0], tokens[2])


def test_reading_one_tensor_at_a_time_equals_the_memory_map(hf_dir, tmp_path):
  from jaxroll.model import safetensors_io

  path = os.path.join(hf_dir("qwen2", tie=True), "model.safetensors")
  mapped = safetensors_io.load(path)
  f = safetensors_io.SafetensorsFile(path)
  assert sorted(f.names()) == sorted(mapped)
  for name, arr in mapped.items():
    got = f.read(name)
    assert got.dtype == arr.dtype and got.flags.writeable
    np.testing.assert_array_equal(got, arr)
  cut = tmp_path / "cut.safetensors"
  cut.write_bytes(open(path, "rb").read()[:-16])
  with pytest.raises(safetensors_io.SafetensorsError, match="truncated|inconsistent"):
    g = safetensors_io.SafetensorsFile(str(cut))
    for name in g.names():
      g.read(name)
