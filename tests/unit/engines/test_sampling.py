"""Sampling: parameter checks, greedy, seeded reproducibility independent of batch company, top-k/top-p, stops."""

from __future__ import annotations

import collections

import pytest
import torch

from gyre.engines.sampling import (
    RequestSampler,
    SamplingParams,
    StopChecker,
    StopResult,
    load_eos_token_ids,
    position_uniform,
    sample_next,
)
from gyre.engines.temperature import logprob_temperature

VOCAB = 50


def logits_rows(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.1),
        dict(temperature=float("nan")),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(top_k=1.5),
        dict(max_new_tokens=-1),
        dict(max_new_tokens=True),
        dict(seed=-1),
        dict(stop=("",)),
        dict(stop=(1,)),
        dict(stop_token_ids=(-1,)),
        dict(stop_token_ids=("a",)),
        dict(ignore_eos="yes"),
        dict(stop=tuple(f"s{i}" for i in range(17))),
    ],
)
def test_bad_params_raise_value_error(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_lists_and_a_bare_stop_string_are_accepted() -> None:
    params = SamplingParams(stop=["a", "b"], stop_token_ids=[3])  # type: ignore[arg-type]
    assert params.stop == ("a", "b") and params.stop_token_ids == (3,)
    assert SamplingParams(stop="x").stop == ("x",)  # type: ignore[arg-type]


def test_greedy_is_argmax_and_logprob_is_raw_log_softmax() -> None:
    logits = logits_rows(3)
    samplers = [RequestSampler(SamplingParams(temperature=0), seed=i) for i in range(3)]
    tokens, logprobs = sample_next(logits, samplers, [0, 1, 2])
    assert tokens == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1)[torch.arange(3), torch.tensor(tokens)]
    assert torch.allclose(torch.tensor(logprobs), expected)


def test_logprob_is_taken_at_the_temperature_and_ignores_filters() -> None:
    logits = logits_rows(1)
    sampler = RequestSampler(SamplingParams(temperature=0.3, top_k=3, top_p=0.9), seed=1)
    tokens, logprobs = sample_next(logits, [sampler], [7])
    assert logprobs[0] == pytest.approx(torch.log_softmax(logits[0] / 0.3, -1)[tokens[0]].item())


def test_each_row_reports_log_probs_at_its_own_temperature() -> None:
    # A batch mixes greedy (taken at 1), 0.7 and 1.0 rows: each log-prob is that of the distribution its token was
    # drawn from, which the trainer reproduces by dividing its logits by the same temperature.
    logits = logits_rows(3)
    temperatures = [0.0, 0.7, 1.0]
    samplers = [RequestSampler(SamplingParams(temperature=t), seed=i) for i, t in enumerate(temperatures)]
    tokens, logprobs = sample_next(logits, samplers, [3, 4, 5])
    for row, (token, logprob) in enumerate(zip(tokens, logprobs)):
        scale = logprob_temperature(temperatures[row])
        assert logprob == pytest.approx(torch.log_softmax(logits[row] / scale, -1)[token].item(), abs=1e-6)
    assert logprob_temperature(0.0) == 1.0 and logprob_temperature(1e-6) == 1.0 and logprob_temperature(0.7) == 0.7


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=10),
                                    SamplingParams(top_p=0.7)])
def test_same_seed_same_tokens_whatever_the_batch(params: SamplingParams) -> None:
    # The request's own logits row is the same in every run; the rows around it change with the company.
    def run(company: int) -> list[int]:
        mine = RequestSampler(params, seed=1234)
        others = [RequestSampler(SamplingParams(temperature=0.5 + 0.1 * i), 100 + i) for i in range(company)]
        out = []
        for step in range(30):
            own = logits_rows(1, seed=step)[0]
            noise = logits_rows(company, seed=1000 + step) if company else torch.empty(0, VOCAB)
            batch = torch.cat([noise[: company // 2], own.unsqueeze(0), noise[company // 2 :]])
            order = others[: company // 2] + [mine] + others[company // 2 :]
            tokens, _ = sample_next(batch, order, [step] * (company + 1))
            out.append(tokens[company // 2])
        return out

    alone = run(0)
    assert run(3) == alone
    assert run(8) == alone
    assert len(set(alone)) > 1  # really sampling, not a constant


def test_noise_is_a_function_of_seed_and_position() -> None:
    sampler = RequestSampler(SamplingParams(), 99)
    assert [sampler.uniform(p) for p in range(50)] == [position_uniform(99, p) for p in range(50)]
    assert sampler.uniform(3) == RequestSampler(SamplingParams(), 99).uniform(3)  # no hidden stream state
    draws = [position_uniform(seed, p) for seed in range(20) for p in range(200)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert len(set(draws)) == len(draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.01
    assert abs(sum(u < 0.1 for u in draws) / len(draws) - 0.1) < 0.01
    with pytest.raises(ValueError):
        sampler.uniform(-1)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)])
def test_a_generation_cut_and_resumed_continues_with_the_same_tokens(params: SamplingParams) -> None:
    """A toy autoregressive model (logits from the last token) sampled from position 5 on; cut after k tokens and
    resumed from prompt + those tokens with a fresh sampler of the same seed, it gives the same tokens."""
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(3)) * 2

    def generate(prompt: list[int], count: int) -> list[int]:
        sampler = RequestSampler(params, seed=4321)
        tokens = list(prompt)
        for _ in range(count):
            next_ids, _ = sample_next(table[tokens[-1]].unsqueeze(0), [sampler], [len(tokens)])
            tokens.extend(next_ids)
        return tokens[len(prompt):]

    prompt = [1, 2, 3, 4, 5]
    whole = generate(prompt, 40)
    assert len(set(whole)) > 5
    for k in (1, 17, 39):
        assert whole[:k] + generate(prompt + whole[:k], 40 - k) == whole


def test_different_seeds_differ() -> None:
    logits = logits_rows(1)
    a = [sample_next(logits, [RequestSampler(SamplingParams(), 1)], [p])[0][0] for p in range(20)]
    b = [sample_next(logits, [RequestSampler(SamplingParams(), 2)], [p])[0][0] for p in range(20)]
    assert a != b


def empirical(params: SamplingParams, logits: torch.Tensor, draws: int) -> collections.Counter:
    sampler = RequestSampler(params, seed=5)
    batch = logits.unsqueeze(0)
    return collections.Counter(sample_next(batch, [sampler], [p])[0][0] for p in range(draws))


def test_top_k_keeps_the_k_most_likely() -> None:
    logits = logits_rows(1)[0]
    counts = empirical(SamplingParams(top_k=3), logits, 300)
    assert set(counts) <= set(torch.topk(logits, 3).indices.tolist())
    assert len(counts) == 3


def test_top_p_keeps_the_nucleus() -> None:
    logits = torch.tensor([3.0, 2.0, 1.0, -5.0, -5.0, -5.0])
    probs = torch.softmax(logits, -1)
    assert probs[0] < 0.8 < probs[0] + probs[1]  # nucleus at 0.8 is tokens {0, 1}
    counts = empirical(SamplingParams(top_p=0.8), logits, 300)
    assert set(counts) == {0, 1}


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    draws = 4000
    counts = empirical(SamplingParams(temperature=1.0), logits, draws)
    expected = torch.softmax(logits, -1).tolist()
    for token, p in enumerate(expected):
        assert abs(counts[token] / draws - p) < 0.03
    cold = empirical(SamplingParams(temperature=0.25), logits, 500)
    assert cold[0] / 500 > 0.9


class WordTokenizer:
    """A stand-in with the `tokenizers.Tokenizer.decode` signature: token i is the word w{i}, joined by spaces."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(f"w{i}" for i in ids)


def test_stop_checker_order_and_reasons() -> None:
    eos = frozenset({9})
    checker = StopChecker(SamplingParams(stop_token_ids=(4,), max_new_tokens=5), eos, None, 5)
    assert checker.check([1, 2]) is None
    assert checker.check([1, 4]) == StopResult("stop", 4)
    assert checker.check([1, 9]) == StopResult("stop", 9)
    assert checker.check([1, 2, 3, 5, 6]) == StopResult("length", None)
    ignoring = StopChecker(SamplingParams(stop_token_ids=(4,), ignore_eos=True), eos, None, 10)
    assert ignoring.check([9]) is None
    assert ignoring.check([4]) == StopResult("stop", 4)  # explicit stop ids still apply


def test_stop_strings_need_a_tokenizer_and_match_across_tokens() -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        StopChecker(SamplingParams(stop=("w2 w3",)), frozenset(), None, 10)
    checker = StopChecker(SamplingParams(stop=("w2 w3",)), frozenset(), WordTokenizer(), 10)
    assert checker.check([1, 2]) is None
    assert checker.check([1, 2, 3]) == StopResult("stop", "w2 w3")
    long_output = list(range(100, 140)) + [2, 3]
    assert checker.check(long_output) == StopResult("stop", "w2 w3")


def test_eos_ids_from_generation_config_and_config(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"eos_token_id": 5}')
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 8]}')
    assert load_eos_token_ids(tmp_path) == frozenset({5, 7, 8})
    assert load_eos_token_ids(tmp_path / "missing") == frozenset()


def test_engine_generation_aborted_and_resumed_on_another_engine_is_token_identical(tiny_model_dir) -> None:
    """Two embedded engines of the tiny model, temperature 1.0, a fixed seed: a generation cut after k tokens (aborted
    on the first engine) and resubmitted to the second as prompt + partial output with the remaining budget ends with
    the tokens of an uninterrupted run, and its partial tokens keep their log-probs."""
    from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig

    torch.set_num_threads(1)
    config = EngineConfig(block_size_tokens=4, num_blocks=128, max_context_tokens=256, max_prefill_tokens=64,
                          num_threads=1)
    first, second = EmbeddedEngine(tiny_model_dir, config), EmbeddedEngine(tiny_model_dir, config)
    prompt = [11, 402, 73, 1290, 5, 77, 301, 9]
    budget, k = 40, 13

    def params(max_new_tokens: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=2024, ignore_eos=True)

    def run(engine, rid: str, ids: list[int], max_new_tokens: int, cut_after: int | None = None):
        engine.submit(rid, ids, params(max_new_tokens))
        generated = 0
        while True:
            for event in engine.step():
                generated += len(event.token_ids)
                if event.finished is not None:
                    return event.finished
            if cut_after is not None and generated >= cut_after:
                engine.abort(rid)
                cut_after = None

    whole = run(first, "whole", prompt, budget)
    assert len(whole.output_ids) == budget and len(set(whole.output_ids)) > 5
    cut = run(first, "cut", prompt, budget, cut_after=k)
    assert cut.finish_reason == "abort" and len(cut.output_ids) == k
    rest = run(second, "rest", prompt + list(cut.output_ids), budget - k)
    assert cut.output_ids + rest.output_ids == whole.output_ids
    assert cut.output_logprobs == pytest.approx(whole.output_logprobs[:k], abs=1e-5)
    assert rest.output_logprobs == pytest.approx(whole.output_logprobs[k:], abs=1e-4)
