"""EmbeddedEngine against transformers' Qwen3ForCausalLM, plus its batching, stop, pause, weight and KV-move rules.

The model is a small random Qwen3 written with transformers' own save_pretrained (no tokenizer), so the reference
is the real Hugging Face implementation, not a copy of ours.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import shutil
from pathlib import Path

import attrs
import pytest
import torch

from gyre.engines.async_engine import AsyncEngine
from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig, GenerateOutput, SamplingParams
from gyre.engines.errors import EngineFailed, EngineOverloaded, RequestError

transformers = pytest.importorskip("transformers")

VOCAB = 256
TOL = 1e-4
CONFIG = EngineConfig(block_size_tokens=4, num_blocks=256, max_context_tokens=512, max_prefill_tokens=48)


def build_model_dir(path: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.1,  # peaked enough that greedy choices are far from ties
    )
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # ones by default: perturb so the norm weights are really exercised
                param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """A tiny model gains nothing from intra-op threads, and on a shared CPU they cost 100x in waiting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("qwen3_engine") / "model", seed=0)


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("qwen3_engine_b") / "model", seed=1)


@pytest.fixture(scope="session")
def hf_model(model_dir: Path):
    return transformers.Qwen3ForCausalLM.from_pretrained(model_dir).eval()


def ref_logprobs(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[len(ids), V] log-probs of the next token after each prefix at `temperature`, from transformers."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float() / temperature, -1)


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: EmbeddedEngine, max_steps: int = 5000) -> dict[str, GenerateOutput]:
    done: dict[str, GenerateOutput] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return done
        for event in engine.step():
            if event.finished is not None:
                done[event.rid] = event.finished
    raise AssertionError("engine did not finish")


def check_against_reference(
    model, ids: list[int], output: GenerateOutput, greedy: bool = True, temperature: float = 1.0
) -> None:
    """Every output log-prob matches transformers on the full sequence (at the temperature a sampled request used);
    greedy tokens are its argmax."""
    full = ids + list(output.output_ids)
    ref = ref_logprobs(model, full, temperature)
    for j, token in enumerate(output.output_ids):
        row = ref[len(ids) - 1 + j]
        assert abs(row[token].item() - output.output_logprobs[j]) < TOL
        if greedy:
            assert token == int(row.argmax())


GREEDY = SamplingParams(max_new_tokens=12, temperature=0)


# ---- parity -----------------------------------------------------------------------------------------------------


def test_prompt_logprobs_match_transformers_through_the_paged_path(model_dir: Path, hf_model) -> None:
    engine = EmbeddedEngine(model_dir, CONFIG)
    ids = prompt(1, 150)  # longer than max_prefill_tokens: chunked, later chunks read earlier KV from the pool
    mine = torch.tensor(engine.prompt_logprobs(ids))
    ref = ref_logprobs(hf_model, ids)
    expected = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert mine.shape == expected.shape
    assert (mine - expected).abs().max().item() < TOL


@pytest.mark.parametrize("staging_bytes", [CONFIG.decode_staging_bytes, 0], ids=["staged", "gathered"])
def test_mixed_length_batch_matches_transformers(model_dir: Path, hf_model, staging_bytes: int) -> None:
    engine = EmbeddedEngine(model_dir, attrs.evolve(CONFIG, decode_staging_bytes=staging_bytes))
    prompts = {f"r{n}": prompt(n, n) for n in (1, 3, 4, 17, 40, 90)}
    for rid, ids in prompts.items():
        engine.submit(rid, ids, GREEDY)
    outputs = run(engine)
    for rid, ids in prompts.items():
        out = outputs[rid]
        assert out.finish_reason == "length" and len(out.output_ids) == 12
        assert out.output_versions == (0,) * 12
        check_against_reference(hf_model, ids, out)


def test_prefix_cache_hits_give_the_same_results(model_dir: Path, hf_model) -> None:
    engine = EmbeddedEngine(model_dir, CONFIG)
    first = prompt(2, 30)
    engine.submit("turn1", first, GREEDY)
    out1 = run(engine)["turn1"]
    assert out1.cached_tokens == 0
    # The next turn of the same session: the previous prompt and output, plus an observation.
    second = first + list(out1.output_ids) + prompt(3, 9)
    engine.submit("turn2", second, GREEDY)
    out2 = run(engine)["turn2"]
    computed_before = len(first) + len(out1.output_ids) - 1  # the last output token never had its KV computed
    assert out2.cached_tokens == computed_before // 4 * 4
    check_against_reference(hf_model, second, out2)
    stats = engine.stats()
    assert stats.cached_tokens_total == out2.cached_tokens
    assert stats.prompt_tokens_total == len(first) + len(second)
    # Identical prompts at once: the second is admitted after the first cached its prompt or not; results agree.
    for rid in ("a", "b"):
        engine.submit(rid, second, GREEDY)
    outputs = run(engine)
    assert outputs["a"].output_ids == outputs["b"].output_ids == out2.output_ids


def test_requests_arriving_together_share_one_prefill(model_dir: Path, hf_model) -> None:
    """A GRPO group (same prompt) and sessions with one system prompt arrive at once: only one computes it."""
    engine = EmbeddedEngine(model_dir, CONFIG)
    system = prompt(60, 24)
    group = prompt(61, 40)
    for i in range(4):
        engine.submit(f"g{i}", group, SamplingParams(max_new_tokens=5, temperature=0.8, seed=i))
    sessions = {f"s{i}": system + prompt(70 + i, 9) for i in range(3)}
    for rid, ids in sessions.items():
        engine.submit(rid, ids, GREEDY)
    outputs = run(engine)
    assert [outputs[f"g{i}"].cached_tokens for i in range(4)] == [0, 36, 36, 36]  # (40 - 1) // 4 whole blocks
    assert sorted(outputs[rid].cached_tokens for rid in sessions) == [0, 24, 24]
    assert len({outputs[f"g{i}"].output_ids for i in range(4)}) > 1  # different seeds, really sampled
    for rid, ids in sessions.items():
        check_against_reference(hf_model, ids, outputs[rid])
    for i in range(4):
        check_against_reference(hf_model, group, outputs[f"g{i}"], greedy=False, temperature=0.8)


def test_tied_embeddings_and_model_dir_errors(tmp_path: Path) -> None:
    torch.manual_seed(3)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=True, initializer_range=0.1, rope_theta=500.0,
    )
    tied = transformers.Qwen3ForCausalLM(config).eval()
    tied.save_pretrained(tmp_path / "tied", safe_serialization=True)
    engine = EmbeddedEngine(tmp_path / "tied", CONFIG)
    ids = prompt(50, 20)
    ref = ref_logprobs(tied, ids)[torch.arange(19), torch.tensor(ids[1:])]
    assert (torch.tensor(engine.prompt_logprobs(ids)) - ref).abs().max().item() < TOL

    with pytest.raises(RequestError, match="config.json"):
        EmbeddedEngine(tmp_path / "missing", CONFIG)
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "tied", bad)
    raw = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**raw, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(RequestError, match="rope type"):
        EmbeddedEngine(bad, CONFIG)
    (bad / "config.json").write_text(json.dumps({**raw, "model_type": "llama"}))
    with pytest.raises(RequestError, match="qwen3"):
        EmbeddedEngine(bad, CONFIG)


# ---- continuous batching ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("staging_bytes", [CONFIG.decode_staging_bytes, 0], ids=["staged", "gathered"])
def test_requests_join_and_leave_between_steps(model_dir: Path, hf_model, staging_bytes: int) -> None:
    engine = EmbeddedEngine(model_dir, attrs.evolve(CONFIG, decode_staging_bytes=staging_bytes))
    a, b = prompt(4, 10), prompt(5, 25)
    engine.submit("a", a, SamplingParams(max_new_tokens=6, temperature=0))
    events = []
    for _ in range(3):
        events += engine.step()
    assert engine.stats().running == 1
    engine.submit("b", b, SamplingParams(max_new_tokens=20, temperature=0))
    seen_both = False
    done: dict[str, GenerateOutput] = {}
    while engine.has_work():
        if engine.stats().running == 2:
            seen_both = True
        for event in engine.step():
            if event.finished is not None:
                done[event.rid] = event.finished
        if "a" in done and "b" not in done:
            assert engine.stats().running == 1  # a left, b goes on
    assert seen_both
    check_against_reference(hf_model, a, done["a"])
    check_against_reference(hf_model, b, done["b"])
    # Streamed token events add up to the final output.
    streamed = [t for e in events if e.rid == "a" for t in e.token_ids]
    assert tuple(streamed) == done["a"].output_ids[: len(streamed)]


def test_staggered_arrivals_and_departures_match_transformers(model_dir: Path, hf_model) -> None:
    """Requests arrive every few steps and leave at different lengths, so decode rows are reused, left as holes,
    refilled by newcomers and rebuilt when a sequence outgrows them."""
    engine = EmbeddedEngine(model_dir, CONFIG)
    plan = [(0, 5, 30), (0, 9, 6), (2, 14, 12), (4, 3, 45), (9, 20, 8), (9, 7, 20), (15, 11, 10)]
    prompts: dict[str, list[int]] = {}
    done: dict[str, GenerateOutput] = {}
    step = 0
    while len(done) < len(plan):
        for i, (at, length, new_tokens) in enumerate(plan):
            if at == step:
                prompts[f"q{i}"] = prompt(100 + i, length)
                engine.submit(f"q{i}", prompts[f"q{i}"], SamplingParams(max_new_tokens=new_tokens, temperature=0))
        for event in engine.step():
            if event.finished is not None:
                done[event.rid] = event.finished
        step += 1
        assert step < 500
    for i, (_, _, new_tokens) in enumerate(plan):
        assert len(done[f"q{i}"].output_ids) == new_tokens
        check_against_reference(hf_model, prompts[f"q{i}"], done[f"q{i}"])


def test_retraction_under_kv_pressure_keeps_results(model_dir: Path, hf_model) -> None:
    config = EngineConfig(block_size_tokens=4, num_blocks=40, max_context_tokens=128, max_prefill_tokens=64)
    engine = EmbeddedEngine(model_dir, config)
    prompts = {f"p{i}": prompt(10 + i, 20) for i in range(4)}
    for rid, ids in prompts.items():
        engine.submit(rid, ids, SamplingParams(max_new_tokens=40, temperature=0))
    outputs = run(engine)
    assert engine.stats().retractions > 0
    for rid, ids in prompts.items():
        assert len(outputs[rid].output_ids) == 40
        check_against_reference(hf_model, ids, outputs[rid])
    assert engine.stats().running == 0


# ---- stop conditions --------------------------------------------------------------------------------------------


def test_stop_token_ids_and_max_new_tokens(model_dir: Path) -> None:
    engine = EmbeddedEngine(model_dir, CONFIG)
    ids = prompt(6, 12)
    engine.submit("free", ids, GREEDY)
    free = run(engine)["free"].output_ids
    stop_at = next(j for j in range(2, 12) if free[j] not in free[:j])
    engine.submit("stop", ids, SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=(free[stop_at],)))
    out = run(engine)["stop"]
    assert out.finish_reason == "stop" and out.matched_stop == free[stop_at]
    assert out.output_ids == free[: stop_at + 1]  # the stop token is kept
    engine.submit("zero", ids, SamplingParams(max_new_tokens=0))
    zero = run(engine)["zero"]
    assert zero.output_ids == () and zero.finish_reason == "length"


def test_eos_from_generation_config_and_ignore_eos(model_dir: Path, tmp_path: Path) -> None:
    ids = prompt(7, 12)
    engine = EmbeddedEngine(model_dir, CONFIG)
    engine.submit("free", ids, GREEDY)
    free = run(engine)["free"].output_ids
    stop_at = next(j for j in range(1, 12) if free[j] not in free[:j])
    eos_dir = tmp_path / "eos"
    shutil.copytree(model_dir, eos_dir)
    (eos_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [free[stop_at], VOCAB - 1]}))
    eos_engine = EmbeddedEngine(eos_dir, CONFIG)
    eos_engine.submit("eos", ids, GREEDY)
    eos_engine.submit("ignore", ids, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    outputs = run(eos_engine)
    assert outputs["eos"].finish_reason == "stop" and outputs["eos"].matched_stop == free[stop_at]
    assert outputs["eos"].output_ids == free[: stop_at + 1]
    assert outputs["ignore"].output_ids == free and outputs["ignore"].finish_reason == "length"


def test_stop_strings_with_a_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    word_dir = tmp_path / "words"
    shutil.copytree(model_dir, word_dir)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(word_dir / "tokenizer.json"))
    ids = prompt(8, 10)
    engine = EmbeddedEngine(word_dir, CONFIG)
    engine.submit("free", ids, GREEDY)
    free = run(engine)["free"].output_ids
    text = tokenizer.decode([free[3], free[4]])
    engine.submit("stop", ids, SamplingParams(max_new_tokens=12, temperature=0, stop=(text,)))
    out = run(engine)["stop"]
    assert out.finish_reason == "stop" and out.matched_stop == text
    assert len(out.output_ids) <= 5 and out.output_ids == free[: len(out.output_ids)]
    no_tokenizer = EmbeddedEngine(model_dir, CONFIG)
    with pytest.raises(RequestError, match="tokenizer"):
        no_tokenizer.submit("x", ids, SamplingParams(stop=("w1",)))


# ---- abort, pause, continue -------------------------------------------------------------------------------------


def test_abort_waiting_and_running_requests_frees_their_blocks(model_dir: Path) -> None:
    config = EngineConfig(block_size_tokens=4, num_blocks=256, max_context_tokens=512, max_running_requests=1)
    engine = EmbeddedEngine(model_dir, config)
    engine.submit("running", prompt(9, 20), SamplingParams(max_new_tokens=50))
    engine.submit("waiting", prompt(10, 20), SamplingParams(max_new_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.stats().running == 1 and engine.stats().waiting == 1
    assert engine.abort("waiting") and engine.abort("running")
    assert not engine.abort("unknown")
    outputs = run(engine)
    assert outputs["running"].finish_reason == "abort" and len(outputs["running"].output_ids) == 3
    assert outputs["waiting"].finish_reason == "abort" and outputs["waiting"].output_ids == ()
    stats = engine.stats()
    assert stats.running == stats.waiting == 0
    assert stats.free_blocks + stats.cached_blocks == stats.total_blocks  # nothing leaked


def test_pause_in_place_then_continue_yields_the_same_tokens(model_dir: Path) -> None:
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=77)
    ids = prompt(11, 15)
    baseline = EmbeddedEngine(model_dir, CONFIG)
    baseline.submit("r", ids, params)
    expected = run(baseline)["r"]

    engine = EmbeddedEngine(model_dir, CONFIG)
    engine.submit("r", ids, params)
    engine.submit("other", prompt(12, 5), SamplingParams(max_new_tokens=60, seed=3))  # different batch company
    for _ in range(10):
        engine.step()
    assert engine.pause("in_place") == 2
    assert not engine.has_work() and engine.step() == []
    engine.continue_generation()
    outputs = run(engine)
    assert outputs["r"].output_ids == expected.output_ids
    assert outputs["r"].output_logprobs == pytest.approx(expected.output_logprobs, abs=TOL)


def test_pause_retract_then_continue_yields_the_same_tokens(model_dir: Path) -> None:
    params = SamplingParams(max_new_tokens=25, temperature=0.9, top_k=20, seed=5)
    ids = prompt(13, 18)
    baseline = EmbeddedEngine(model_dir, CONFIG)
    baseline.submit("r", ids, params)
    expected = run(baseline)["r"]
    engine = EmbeddedEngine(model_dir, CONFIG)
    engine.submit("r", ids, params)
    for _ in range(8):
        engine.step()
    engine.pause("retract")
    assert engine.stats().running == 0 and engine.stats().waiting == 1
    engine.continue_generation()
    assert run(engine)["r"].output_ids == expected.output_ids


def test_pause_abort_aborts_everything(model_dir: Path) -> None:
    engine = EmbeddedEngine(model_dir, CONFIG)
    engine.submit("r", prompt(14, 8), SamplingParams(max_new_tokens=50))
    engine.step()
    assert engine.pause("abort") == 1
    outputs = run(engine)
    assert outputs["r"].finish_reason == "abort"
    with pytest.raises(RequestError):
        engine.pause("sideways")


# ---- weights ----------------------------------------------------------------------------------------------------


def test_weight_update_changes_outputs_and_versions(model_dir: Path, other_model_dir: Path) -> None:
    from safetensors.torch import load_file

    engine = EmbeddedEngine(model_dir, CONFIG)
    ids = prompt(15, 20)
    engine.submit("before", ids, GREEDY)
    before = run(engine)["before"]
    new_weights = load_file(str(other_model_dir / "model.safetensors"))
    engine.load_weights(new_weights, version=3)
    assert engine.weight_version == 3 and engine.stats().cached_blocks == 0  # the cache went with the old weights
    engine.submit("after", ids, GREEDY)
    after = run(engine)["after"]
    assert after.output_versions == (3,) * 12 and after.cached_tokens == 0
    assert after.output_ids != before.output_ids
    hf_other = transformers.Qwen3ForCausalLM.from_pretrained(other_model_dir).eval()
    check_against_reference(hf_other, ids, after)

    # A request paused in place across an update: its tokens carry the version that produced each of them.
    engine.submit("across", ids, SamplingParams(max_new_tokens=10, temperature=0))
    for _ in range(5):
        engine.step()
    engine.pause("in_place")
    engine.load_weights_from_disk(model_dir, version=4)
    engine.continue_generation()
    across = run(engine)["across"]
    assert across.output_versions == (3,) * 5 + (4,) * 5  # each step (the prefill too) samples one token

    with pytest.raises(RequestError, match="unknown tensor"):
        engine.load_weights({"model.bogus.weight": torch.zeros(1)}, version=5)
    with pytest.raises(RequestError, match="shape"):
        engine.load_weights({"model.norm.weight": torch.zeros(3)}, version=5)
    assert engine.weight_version == 4


def test_partial_weight_update(model_dir: Path, hf_model) -> None:
    engine = EmbeddedEngine(model_dir, CONFIG)
    ids = prompt(16, 12)
    norm = hf_model.state_dict()["model.norm.weight"]
    engine.load_weights({"model.norm.weight": norm * 2.0}, version=1)
    hf_copy = transformers.Qwen3ForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        hf_copy.model.norm.weight.mul_(2.0)
    mine = torch.tensor(engine.prompt_logprobs(ids))
    ref = ref_logprobs(hf_copy, ids)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert (mine - ref).abs().max().item() < TOL


def test_release_and_resume_memory(model_dir: Path) -> None:
    engine = EmbeddedEngine(model_dir, CONFIG)
    ids = prompt(17, 10)
    engine.submit("a", ids, GREEDY)
    expected = run(engine)["a"].output_ids
    engine.load_weights({"model.norm.weight": torch.zeros(64)}, version=9)
    engine.release_memory(None)
    assert engine.stats().memory_released == ("kv_cache", "weights")
    with pytest.raises(RequestError, match="released"):
        engine.submit("b", ids, GREEDY)
    with pytest.raises(RequestError, match="unknown memory tags"):
        engine.release_memory(["gpu"])
    engine.resume_memory(None)
    assert engine.weight_version == 0  # weights come back from the checkpoint on disk
    engine.submit("b", ids, GREEDY)
    out = run(engine)["b"]
    assert out.output_ids == expected and out.cached_tokens == 0


def test_release_needs_an_idle_engine(model_dir: Path) -> None:
    engine = EmbeddedEngine(model_dir, CONFIG)
    engine.submit("a", prompt(18, 5), GREEDY)
    with pytest.raises(RequestError, match="idle"):
        engine.release_memory(["kv_cache"])


def test_flush_cache(model_dir: Path) -> None:
    engine = EmbeddedEngine(model_dir, CONFIG)
    engine.submit("a", prompt(19, 30), SamplingParams(max_new_tokens=4))
    engine.step()
    assert engine.flush_cache() is False  # in flight and not paused
    run(engine)
    assert engine.stats().cached_blocks > 0
    assert engine.flush_cache() is True
    assert engine.stats().cached_blocks == 0
    assert engine.stats().free_blocks == CONFIG.num_blocks


# ---- bounds and bad input -----------------------------------------------------------------------------------------


def test_bad_requests_are_refused(model_dir: Path) -> None:
    config = EngineConfig(block_size_tokens=4, num_blocks=64, max_context_tokens=64, max_waiting_requests=2)
    engine = EmbeddedEngine(model_dir, config)
    with pytest.raises(RequestError, match="empty"):
        engine.submit("a", [], GREEDY)
    with pytest.raises(RequestError, match="token id"):
        engine.submit("a", [1, VOCAB], GREEDY)
    with pytest.raises(RequestError, match="token id"):
        engine.submit("a", [1, "2"], GREEDY)  # type: ignore[list-item]
    with pytest.raises(RequestError, match="max_context_tokens"):
        engine.submit("a", [1] * 64, GREEDY)
    engine.submit("a", [1, 2], GREEDY)
    with pytest.raises(RequestError, match="already in flight"):
        engine.submit("a", [1, 2], GREEDY)
    engine.submit("b", [1, 2], GREEDY)
    with pytest.raises(EngineOverloaded):
        engine.submit("c", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="exceeds the pool"):
        EngineConfig(block_size_tokens=4, num_blocks=8, max_context_tokens=64)


def test_context_limit_ends_with_length(model_dir: Path) -> None:
    config = EngineConfig(block_size_tokens=4, num_blocks=64, max_context_tokens=20)
    engine = EmbeddedEngine(model_dir, config)
    engine.submit("a", prompt(20, 15), SamplingParams(max_new_tokens=100))
    out = run(engine)["a"]
    assert out.finish_reason == "length" and len(out.output_ids) == 5


# ---- export / import ----------------------------------------------------------------------------------------------


def test_export_import_between_two_engines_with_a_byte_copy_fill(model_dir: Path, hf_model) -> None:
    source = EmbeddedEngine(model_dir, CONFIG)
    target = EmbeddedEngine(model_dir, CONFIG)
    # Occupy some blocks on the target so its block ids differ from the source's.
    target.submit("noise", prompt(21, 40), SamplingParams(max_new_tokens=3))
    run(target)
    ids = prompt(22, 37)
    source.submit("s", ids, GREEDY)
    out = run(source)["s"]
    session = ids + list(out.output_ids)
    exported = source.export_prefix(session)
    assert exported.num_tokens == (len(session) - 1) // 4 * 4 and len(exported.block_ids) == exported.num_tokens // 4
    assert source.stats().exports == 1
    src_layout, dst_layout = source.kv_layout(), target.kv_layout()
    assert src_layout.compatible_with(dst_layout)

    def fill(dest: list[int]) -> None:
        # What Mooncake does: copy bytes between the addresses the layouts name.
        src_addrs = src_layout.block_addrs(exported.block_ids[: len(dest)])
        dst_addrs = dst_layout.block_addrs(dest)
        for s, d in zip(src_addrs, dst_addrs):
            ctypes.memmove(d, s, src_layout.block_nbytes)

    imported = target.import_prefix(session[: exported.num_tokens], fill)
    assert imported == exported.num_tokens
    assert target.import_prefix(session[: exported.num_tokens], fill) == 0  # already cached: nothing to move
    source.release_export(exported.handle)
    assert source.stats().exports == 0
    with pytest.raises(RequestError, match="unknown export"):
        source.release_export(exported.handle)

    follow_up = session + prompt(23, 6)
    target.submit("t", follow_up, GREEDY)
    moved = run(target)["t"]
    assert moved.cached_tokens == exported.num_tokens
    check_against_reference(hf_model, follow_up, moved)


def test_export_of_a_live_request_and_a_failing_fill(model_dir: Path) -> None:
    engine = EmbeddedEngine(model_dir, CONFIG)
    ids = prompt(24, 21)
    engine.submit("live", ids, SamplingParams(max_new_tokens=40, temperature=0))
    for _ in range(6):
        engine.step()
    engine.pause("in_place")
    live_tokens = ids + [0] * 0
    exported = engine.export_prefix(live_tokens)
    assert exported.num_tokens == 20  # the prompt's full blocks, computed by the paused request
    free_before = engine.stats().free_blocks

    def broken(dest: list[int]) -> None:
        raise RuntimeError("peer vanished")

    with pytest.raises(RuntimeError, match="peer vanished"):
        engine.import_prefix(prompt(25, 16), broken)
    assert engine.stats().free_blocks == free_before  # the blocks it took are back
    engine.release_export(exported.handle)
    engine.continue_generation()
    assert run(engine)["live"].finish_reason == "length"


class MemmoveRead:
    """What a Mooncake read does between two engines in one process: copy bytes address to address.

    Records the entries it was handed, so tests see whether a move took one entry or one per block."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.calls: list[int] = []
        self.fail = fail

    def __call__(self, local: list[int], remote: list[int], sizes: list[int]) -> int:
        self.calls.append(len(sizes))
        if self.fail is not None:
            raise self.fail
        for d, s, n in zip(local, remote, sizes):
            ctypes.memmove(d, s, n)
        return sum(sizes)


def session_on(engine: EmbeddedEngine, seed: int) -> list[int]:
    ids = prompt(seed, 37)
    engine.submit(f"s{seed}", ids, GREEDY)
    return ids + list(run(engine)[f"s{seed}"].output_ids)


@pytest.mark.parametrize(
    "source_staging, target_staging, entries",
    [(None, None, 1), (0, None, 2 * 2 * 12), (None, 0, 2 * 2 * 12), (8, None, 2 * 2 * 12)],
    ids=["staged", "exporter-without-staging", "importer-without-staging", "exporter-staging-too-small"],
)
def test_import_exported_moves_one_staged_range_or_falls_back_to_blocks(
    model_dir: Path, hf_model, source_staging: int | None, target_staging: int | None, entries: int
) -> None:
    source = EmbeddedEngine(model_dir, attrs.evolve(CONFIG, kv_staging_tokens=source_staging))
    target = EmbeddedEngine(model_dir, attrs.evolve(CONFIG, kv_staging_tokens=target_staging))
    target.submit("noise", prompt(21, 40), SamplingParams(max_new_tokens=3))  # the two pools' block ids differ
    run(target)
    session = session_on(source, 26)  # 49 tokens: 12 full blocks are cached
    exported = source.export_prefix(session)
    layout = source.kv_layout()
    assert exported.num_tokens == 48
    entry_nbytes = layout.num_layers * 2 * layout.block_nbytes
    if entries == 1:
        assert exported.staging_addr and exported.staging_nbytes == 12 * entry_nbytes
        assert source.staging.free_blocks == source.staging.capacity_blocks - 12
    elif source_staging is not None:
        assert exported.staging_addr == 0 and exported.staging_nbytes == 0

    read = MemmoveRead()
    tokens, nbytes = target.import_exported(session[:48], exported, layout, read)
    assert (tokens, nbytes) == (48, 12 * entry_nbytes)
    assert sum(read.calls) == entries
    if target.staging is not None:
        assert target.staging.free_blocks == target.staging.capacity_blocks  # its region went back
    assert target.import_exported(session[:48], exported, layout, read) == (0, 0)  # cached: nothing moves
    source.release_export(exported.handle)
    if source.staging is not None:
        assert source.staging.free_blocks == source.staging.capacity_blocks

    follow_up = session + prompt(27, 6)
    target.submit("t", follow_up, GREEDY)
    moved = run(target)["t"]
    assert moved.cached_tokens == 48
    check_against_reference(hf_model, follow_up, moved)


class FakeTransferError(RuntimeError):
    def __init__(self, unsafe_ranges: tuple) -> None:
        super().__init__("read failed")
        self.unsafe_ranges = unsafe_ranges


@pytest.mark.parametrize(
    "error, quarantined",
    [(FakeTransferError(((1, 1),)), True), (FakeTransferError(()), False), (RuntimeError("odd"), True)],
    ids=["bytes-may-still-land", "nothing-moved", "unknown-error"],
)
def test_failed_staged_read_frees_blocks_and_quarantines_what_may_still_be_written(
    model_dir: Path, error: BaseException, quarantined: bool
) -> None:
    source, target = EmbeddedEngine(model_dir, CONFIG), EmbeddedEngine(model_dir, CONFIG)
    session = session_on(source, 28)
    exported = source.export_prefix(session)
    free_before = target.stats().free_blocks
    with pytest.raises(type(error)):
        target.import_exported(session[:48], exported, source.kv_layout(), MemmoveRead(fail=error))
    assert target.stats().free_blocks == free_before
    assert target.stats().cached_blocks == 0
    assert target.staging.quarantined_blocks == (12 if quarantined else 0)
    source.release_export(exported.handle)


def test_import_exported_refuses_descriptors_that_do_not_add_up(model_dir: Path) -> None:
    source, target = EmbeddedEngine(model_dir, CONFIG), EmbeddedEngine(model_dir, CONFIG)
    session = session_on(source, 29)
    exported = source.export_prefix(session)
    layout, read = source.kv_layout(), MemmoveRead()
    with pytest.raises(RequestError, match="stages"):
        target.import_exported(session[:48], attrs.evolve(exported, staging_nbytes=100), layout, read)
    with pytest.raises(RequestError, match="tokens given"):
        target.import_exported(session[:44], exported, layout, read)
    with pytest.raises(RequestError, match="incompatible"):
        target.import_exported(session[:48], exported, attrs.evolve(layout, block_size_tokens=8), read)
    assert read.calls == []
    source.release_export(exported.handle)


def test_staging_goes_and_comes_back_with_the_kv_pool(model_dir: Path) -> None:
    engine = EmbeddedEngine(model_dir, attrs.evolve(CONFIG, kv_staging_tokens=10))
    assert engine.staging is not None and engine.staging.capacity_blocks == 3  # rounded up to blocks
    session = session_on(engine, 30)
    exported = engine.export_prefix(session)
    assert exported.staging_addr == 0  # 12 blocks do not fit in 3
    engine.release_export(exported.handle)
    engine.release_memory(["kv_cache"])
    assert engine.staging is None
    engine.resume_memory(["kv_cache"])
    assert engine.staging is not None and engine.staging.free_blocks == 3
    assert EmbeddedEngine(model_dir, attrs.evolve(CONFIG, kv_staging_tokens=0)).staging is None
    assert EmbeddedEngine(model_dir, CONFIG).staging.capacity_blocks == 512 // 4  # one max-context prefix
    with pytest.raises(ValueError, match="kv_staging_tokens"):
        attrs.evolve(CONFIG, kv_staging_tokens=-1)


# ---- AsyncEngine --------------------------------------------------------------------------------------------------


def test_async_engine_generates_concurrently_and_streams(model_dir: Path) -> None:
    async def main() -> None:
        engine = AsyncEngine(EmbeddedEngine(model_dir, CONFIG))
        try:
            outputs = await asyncio.gather(
                *(engine.generate(f"r{i}", prompt(30 + i, 10 + i), GREEDY) for i in range(4))
            )
            assert [o.rid for o in outputs] == ["r0", "r1", "r2", "r3"]
            tokens = []
            async for event in engine.stream("s", prompt(30, 10), GREEDY):
                tokens.extend(event.token_ids)
            assert tuple(tokens) == outputs[0].output_ids
            stats = await engine.stats()
            assert stats.running == 0 and stats.prefix_hit_rate > 0
            with pytest.raises(RequestError):
                await engine.generate("bad", [], GREEDY)
            # Cancelling a waiter aborts its request.
            task = asyncio.ensure_future(engine.generate("long", prompt(40, 5), SamplingParams(max_new_tokens=400)))
            for _ in range(1000):
                if (await engine.stats()).running == 1:
                    break
                await asyncio.sleep(0.005)
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(1000):
                stats = await engine.stats()
                if stats.running == 0:
                    break
                await asyncio.sleep(0.005)
            assert stats.running == 0 and stats.waiting == 0, stats
        finally:
            await engine.close()

    asyncio.run(main())


def test_a_request_awaited_whole_hands_the_loop_only_its_end(model_dir: Path) -> None:
    # generate() needs the finished event only: the worker drops the others instead of waking the loop for each
    # token; stream() still gets one event per token; both see the same tokens.
    params = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)

    async def main() -> tuple[list, list, tuple, list]:
        engine = AsyncEngine(EmbeddedEngine(model_dir, CONFIG))
        handed: list = []
        dispatch = engine._dispatch
        engine._dispatch = lambda events: (handed.extend(events), dispatch(events))  # type: ignore[method-assign]
        try:
            output = await engine.generate("whole", prompt(50, 10), params)
            whole_events = list(handed)
            handed.clear()
            streamed = [event async for event in engine.stream("streamed", prompt(50, 10), params)]
            return whole_events, list(handed), output.output_ids, streamed
        finally:
            await engine.close()

    whole_events, stream_events, output_ids, streamed = asyncio.run(main())
    assert len(output_ids) == 20
    assert [(e.rid, e.finished is not None) for e in whole_events] == [("whole", True)]
    assert len(stream_events) == len(streamed) == 20
    assert tuple(t for e in streamed for t in e.token_ids) == output_ids


def test_async_engine_failure_fails_pending_requests(model_dir: Path) -> None:
    async def main() -> None:
        inner = EmbeddedEngine(model_dir, CONFIG)
        engine = AsyncEngine(inner)

        def exploding_forward(*args, **kwargs):
            raise RuntimeError("simulated kernel fault")

        inner.model.forward = exploding_forward  # type: ignore[method-assign]
        try:
            with pytest.raises(EngineFailed, match="simulated kernel fault"):
                await engine.generate("r", prompt(41, 5), GREEDY)
            with pytest.raises(EngineFailed):
                await engine.stats()
            assert engine.failure is not None
        finally:
            await engine.close()

    asyncio.run(main())
