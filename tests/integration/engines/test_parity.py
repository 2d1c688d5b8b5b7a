"""transformers, the Megatron trainer and the embedded engine give the same log-probs (fp32, within 1e-4).

The model has random weights with a larger spread than init (and random norm weights), so that a wrong head
order, RoPE layout or norm mapping moves log-probs by far more than the tolerance; the last test shows it does.
The embedded engine is checked through every path that produces log-probs: prompt scoring, generation without and
with prefix-cache hits, a batch of requests of mixed lengths, sampling at temperatures other than 1 (log-probs at
the sampling temperature, which the trainer reproduces), and after loading the trainer's updated weights.
"""

from __future__ import annotations

import pytest
import torch

from gyre.engines.model_format import PRESETS, init_model_dir, save_hf_state_dict
from gyre.engines.testing import spread_state_dict
from gyre.engines.trainer import MegatronTrainer, TrainerConfig, token_logprobs

ATOL = 1e-4
VOCAB = 2041


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(2)
    path = init_model_dir(tmp_path_factory.mktemp("parity-model"), "tiny", seed=0)
    state = spread_state_dict(PRESETS["tiny"], seed=11)
    save_hf_state_dict(path, state)
    return path


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference(hf_model, ids: list[int]) -> torch.Tensor:
    """n-1 log-probs from transformers."""
    batch = torch.tensor([ids])
    with torch.no_grad():
        return token_logprobs(hf_model(batch).logits, batch, torch.tensor([len(ids)]))[0, 1:]


def random_ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["sdpa", "local"])
def trainer(request, model_dir):
    return MegatronTrainer(model_dir, TrainerConfig(core_attention=request.param))


@pytest.fixture(scope="module")
def engine_module():
    # H2's engine; imported here so that the transformers/megatron checks run even if it fails to import.
    from gyre.engines import embedded_engine

    return embedded_engine


def new_engine(engine_module, model_dir):
    config = engine_module.EngineConfig(block_size_tokens=16, num_blocks=256, max_context_tokens=1024,
                                        max_prefill_tokens=64, max_running_requests=8)
    return engine_module.EmbeddedEngine(model_dir, config)


def run_to_completion(engine, max_steps: int = 10_000) -> tuple[dict, int]:
    """Step until idle; return finished outputs by rid and the most requests that ran in one step."""
    outputs, most_running = {}, 0
    for _ in range(max_steps):
        if not engine.has_work():
            return outputs, most_running
        events = engine.step()
        most_running = max(most_running, engine.stats().running)
        for event in events:
            if event.finished is not None:
                outputs[event.rid] = event.finished
    raise AssertionError("engine did not finish")


def assert_output_matches(hf_model, prompt: list[int], output) -> None:
    assert len(output.output_logprobs) == len(output.output_ids) > 0
    full = reference(hf_model, prompt + list(output.output_ids))
    expected = full[len(prompt) - 1 :]
    torch.testing.assert_close(torch.tensor(output.output_logprobs), expected, atol=ATOL, rtol=0)


def test_megatron_matches_transformers_on_a_padded_batch(trainer, hf_model):
    lengths = [150, 37, 5, 2]
    rows = [random_ids(100 + i, n) for i, n in enumerate(lengths)]
    ids = torch.zeros(len(rows), max(lengths), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    lp = trainer.logprobs(ids, torch.tensor(lengths))
    assert reference(hf_model, rows[0]).std() > 0.3  # the model is not near-uniform: the comparison means something
    for i, row in enumerate(rows):
        expected = reference(hf_model, row)
        torch.testing.assert_close(lp[i, 1 : len(row)], expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("length", [2, 17, 130])
def test_embedded_prompt_logprobs_match(engine_module, model_dir, hf_model, length):
    engine = new_engine(engine_module, model_dir)
    ids = random_ids(length, length)
    got = torch.tensor(engine.prompt_logprobs(ids))
    torch.testing.assert_close(got, reference(hf_model, ids), atol=ATOL, rtol=0)


def test_embedded_generation_with_and_without_prefix_cache(engine_module, model_dir, hf_model):
    engine = new_engine(engine_module, model_dir)
    params = engine_module.SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = random_ids(7, 70)
    engine.submit("cold", prompt, params)
    cold = run_to_completion(engine)[0]["cold"]
    assert cold.cached_tokens == 0
    assert_output_matches(hf_model, prompt, cold)

    # The next turn extends the finished sequence: its prefix comes from the cache.
    turn2 = prompt + list(cold.output_ids) + random_ids(8, 21)
    engine.submit("warm", turn2, params)
    warm = run_to_completion(engine)[0]["warm"]
    assert warm.cached_tokens >= 64
    assert_output_matches(hf_model, turn2, warm)

    # Same prompt again: greedy decoding from cached KV reproduces the output and its log-probs.
    engine.submit("again", turn2, params)
    again = run_to_completion(engine)[0]["again"]
    assert again.cached_tokens > warm.cached_tokens
    assert again.output_ids == warm.output_ids
    torch.testing.assert_close(torch.tensor(again.output_logprobs), torch.tensor(warm.output_logprobs),
                               atol=ATOL, rtol=0)


def test_embedded_batch_of_mixed_lengths(engine_module, model_dir, hf_model):
    engine = new_engine(engine_module, model_dir)
    prompts = {f"r{n}": random_ids(200 + n, n) for n in (3, 20, 50, 90)}
    for rid, prompt in prompts.items():
        engine.submit(rid, prompt, engine_module.SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True))
    outputs, most_running = run_to_completion(engine)
    assert most_running >= 2  # they really ran together
    for rid, prompt in prompts.items():
        assert_output_matches(hf_model, prompt, outputs[rid])


def test_sampled_log_probs_match_the_trainer_at_the_sampling_temperature(engine_module, model_dir, trainer):
    """Requests sampled at 0.7 and 1.3 in one batch report log-probs at their temperature, and the trainer given the
    same per-token temperatures reproduces them: on-policy importance ratios are 1. At temperature 1 they would not
    be (the negative control)."""
    engine = new_engine(engine_module, model_dir)
    prompts = {0.7: random_ids(400, 30), 1.3: random_ids(401, 45)}
    for temperature, prompt in prompts.items():
        engine.submit(f"t{temperature}", prompt, engine_module.SamplingParams(
            max_new_tokens=10, temperature=temperature, seed=5, ignore_eos=True))
    outputs, most_running = run_to_completion(engine)
    assert most_running == 2
    for temperature, prompt in prompts.items():
        output = outputs[f"t{temperature}"]
        ids = torch.tensor([prompt + list(output.output_ids)])
        lengths = torch.tensor([ids.shape[1]])
        temperatures = torch.ones(ids.shape)
        temperatures[0, len(prompt):] = temperature
        behaviour = torch.tensor(output.output_logprobs)
        at_temperature = trainer.logprobs(ids, lengths, temperatures)[0, len(prompt):]
        torch.testing.assert_close(at_temperature, behaviour, atol=ATOL, rtol=0)
        plain = trainer.logprobs(ids, lengths)[0, len(prompt):]
        assert (plain - behaviour).abs().max() > 100 * ATOL


def test_trainer_update_reaches_the_engine(engine_module, model_dir, hf_model, tmp_path):
    """After an optimizer step, the engine loaded with the trainer's HF weights scores like the trainer."""
    trainer = MegatronTrainer(model_dir, TrainerConfig(lr=1e-2))
    ids = torch.tensor([random_ids(300, 40)])
    lengths = torch.tensor([40])
    trainer.forward_backward(ids, lengths, lambda lp: (-lp.sum(), {}))
    trainer.optimizer_step()
    engine = new_engine(engine_module, model_dir)
    before = torch.tensor(engine.prompt_logprobs(ids[0].tolist()))
    engine.load_weights(trainer.hf_state_dict(), version=trainer.version)
    after = torch.tensor(engine.prompt_logprobs(ids[0].tolist()))
    expected = trainer.logprobs(ids, lengths)[0, 1:]
    assert (before - expected).abs().max() > 100 * ATOL  # the step changed the model
    torch.testing.assert_close(after, expected, atol=ATOL, rtol=0)


def test_the_comparison_detects_a_wrong_head_order(model_dir, hf_model):
    """Negative control: swapping the two KV groups of one layer moves log-probs far beyond the tolerance."""
    from transformers import Qwen3ForCausalLM

    state = {k: v.clone() for k, v in hf_model.state_dict().items()}
    name = "model.layers.1.self_attn.k_proj.weight"
    half = state[name].shape[0] // 2
    state[name] = torch.cat([state[name][half:], state[name][:half]])
    broken = Qwen3ForCausalLM(hf_model.config).eval()
    broken.load_state_dict(state)
    ids = random_ids(400, 60)
    assert (reference(broken, ids) - reference(hf_model, ids)).abs().max() > 100 * ATOL


def test_cli_logprobs_of_the_three_backends_agree(model_dir, hf_model, tmp_path, capsys):
    import json

    from gyre.runtime.cli import main

    ids = random_ids(500, 33)
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(ids))
    expected = reference(hf_model, ids)
    for backend in ("transformers", "megatron", "embedded"):
        capsys.readouterr()
        assert main(["model", "logprobs", str(model_dir), "--backend", backend, "--tokens", str(tokens)]) == 0
        values = json.loads(capsys.readouterr().out)
        assert len(values) == len(ids) - 1
        torch.testing.assert_close(torch.tensor(values), expected, atol=ATOL, rtol=0)
    tokens.write_text("[1]")
    assert main(["model", "logprobs", str(model_dir), "--tokens", str(tokens)]) == 2
    assert "at least two" in capsys.readouterr().err
