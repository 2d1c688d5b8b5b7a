"""The model directory: deterministic from a seed, readable by transformers, and a tokenizer fit for agents."""

from __future__ import annotations

import json

import pytest
import torch

from gyre.engines import model_format, tokenizer
from gyre.engines.errors import ModelFormatError
from gyre.engines.model_format import (
    PRESETS,
    ModelSpec,
    hf_param_shapes,
    init_model_dir,
    init_state_dict,
    load_hf_state_dict,
)


def test_directory_has_the_agreed_files(tiny_model_dir):
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == "float32"
    assert config["head_dim"] == PRESETS["tiny"].head_dim


def test_same_seed_same_bytes_other_seed_other_weights(tiny_model_dir, tmp_path):
    again = init_model_dir(tmp_path / "again", "tiny", seed=0)
    other = init_model_dir(tmp_path / "other", "tiny", seed=1)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    assert (other / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    a, b = load_hf_state_dict(again), load_hf_state_dict(other)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], b["model.layers.0.self_attn.q_proj.weight"])


def test_transformers_loads_every_tensor(tiny_model_dir):
    from transformers import Qwen3ForCausalLM

    model, info = Qwen3ForCausalLM.from_pretrained(tiny_model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state = load_hf_state_dict(tiny_model_dir)
    assert set(state) == set(hf_param_shapes(PRESETS["tiny"]))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    # Untied: the output matrix is its own tensor.
    assert not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])


def test_spec_round_trips_through_config(tiny_model_dir):
    spec = ModelSpec.from_model_dir(tiny_model_dir)
    assert spec == PRESETS["tiny"]
    assert ModelSpec.from_config_dict(spec.config_dict()) == spec


def test_spec_reads_a_transformers_written_config(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                         rope_theta=5000.0)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    spec = ModelSpec.from_model_dir(tmp_path)
    assert (spec.vocab_size, spec.hidden_size, spec.head_dim, spec.num_kv_heads, spec.rope_theta) == (
        300, 64, 16, 2, 5000.0)
    model_format.check_state_dict(spec, load_hf_state_dict(tmp_path))


def test_bad_inputs_raise_typed_errors(tmp_path):
    with pytest.raises(ModelFormatError):
        init_model_dir(tmp_path, preset="huge")
    with pytest.raises(ModelFormatError):
        ModelSpec.from_model_dir(tmp_path)
    with pytest.raises(ModelFormatError):
        ModelSpec(hidden_size=64, num_layers=1, num_heads=3, num_kv_heads=2, head_dim=16, ffn_size=8)
    with pytest.raises(ModelFormatError):
        ModelSpec.from_config_dict({**PRESETS["tiny"].config_dict(), "tie_word_embeddings": "yes"})
    with pytest.raises(ModelFormatError):
        model_format.check_state_dict(PRESETS["tiny"], {"lm_head.weight": torch.zeros(1)})


def test_tokenizer_is_deterministic():
    # The cached build and a fresh training run give the same JSON.
    assert tokenizer._tokenizer_json.__wrapped__() == tokenizer._tokenizer_json()


def test_auto_tokenizer_and_special_tokens(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tok) == tokenizer.VOCAB_SIZE
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for token in (*tokenizer.SPECIAL_TOKENS, *tokenizer.MARKUP_TOKENS):
        ids = tok.encode(token, add_special_tokens=False)
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == token
    # Tool-call markup survives skip_special_tokens (the parser needs it); turn markup does not.
    text = "<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>"
    decoded = tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=True)
    assert decoded == "assistant\n<tool_call>\n{}\n</tool_call>"


@pytest.mark.parametrize(
    "text",
    ["plain words", "ünïcødé ✓ 中文", "tabs\tand\r\nnewlines\n\n", "   leading spaces", '{"a": [1, 2.5e-3]}',
     ""],
)
def test_tokenizer_round_trips_any_text(text):
    tok = tokenizer.build_tokenizer()
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text


def test_agent_text_is_short_in_tokens():
    tok = tokenizer.build_tokenizer()
    samples = [
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "127 * 33"}}\n</tool_call>',
        "Let me read the file src/utils/parser.py and run the tests with python -m pytest -q.",
        "Traceback (most recent call last):\n  File \"tests/test_main.py\", line 12, in <module>\nValueError: bad",
    ]
    chars = sum(len(s) for s in samples)
    tokens = sum(len(tok.encode(s, add_special_tokens=False).ids) for s in samples)
    # Raw bytes would be 1 char per token; the trained merges should give well over 2.
    assert chars / tokens > 2.5, (chars, tokens)


def test_cli_init_and_info(tmp_path, capsys, tiny_model_dir):
    from gyre.runtime.cli import main

    assert main(["model", "init", str(tmp_path / "m"), "--preset", "tiny", "--seed", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["params"] == PRESETS["tiny"].num_params
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    assert main(["model", "info", str(tmp_path / "m")]) == 0
    assert json.loads(capsys.readouterr().out)["head_dim"] == PRESETS["tiny"].head_dim
    assert main(["model", "init", str(tmp_path / "x"), "--preset", "huge"]) == 2
    assert "unknown preset" in capsys.readouterr().err


def test_tied_preset_writes_a_checkpoint_without_lm_head(tmp_path):
    from safetensors import safe_open

    init_model_dir(tmp_path, preset="tiny-tied", seed=0)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    spec = ModelSpec.from_model_dir(tmp_path)
    assert spec == PRESETS["tiny-tied"] and spec.tie_word_embeddings
    assert spec.num_params == PRESETS["tiny"].num_params - spec.vocab_size * spec.hidden_size
    model_format.check_state_dict(spec, load_hf_state_dict(tmp_path))
    with pytest.raises(ModelFormatError):  # an untied checkpoint does not fit a tied spec
        model_format.check_state_dict(spec, init_state_dict(PRESETS["tiny"]))


def test_moe_preset_writes_a_qwen3_moe_directory(tmp_path):
    init_model_dir(tmp_path, preset="tiny-moe", seed=0)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (config["num_experts"], config["num_experts_per_tok"], config["mlp_only_layers"]) == (8, 2, [0])
    spec = ModelSpec.from_model_dir(tmp_path)
    assert spec == PRESETS["tiny-moe"]
    assert [spec.is_sparse_layer(i) for i in range(4)] == [False, True, True, True]
    state = load_hf_state_dict(tmp_path)
    model_format.check_state_dict(spec, state)
    assert "model.layers.0.mlp.gate_proj.weight" in state and "model.layers.1.mlp.gate_proj.weight" not in state
    assert state["model.layers.2.mlp.experts.7.down_proj.weight"].shape == (128, 96)
    assert state["model.layers.3.mlp.gate.weight"].shape == (8, 128)


def test_moe_configs_that_cannot_route_are_refused():
    base = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, ffn_size=8)
    for bad in ({"num_experts": 4, "num_experts_per_tok": 5, "moe_ffn_size": 8},
                {"num_experts": 4, "num_experts_per_tok": 2, "moe_ffn_size": 0},
                {"num_experts": 4, "num_experts_per_tok": 2, "moe_ffn_size": 8, "decoder_sparse_step": 0},
                {"num_experts": 4, "num_experts_per_tok": 2, "moe_ffn_size": 8, "mlp_only_layers": (2,)}):
        with pytest.raises(ModelFormatError):
            ModelSpec(**base, **bad)
