"""Translating engine answers into BackendResults, and the embedded engine's sampling parameters."""

from __future__ import annotations

import pytest

from gyre.actors.serving.backends import result_from_sglang, sampling_params_from_dict
from gyre.actors.serving.backends import BackendRejected, BackendUnavailable


def test_sglang_answer_with_per_token_versions() -> None:
    response = {
        "output_ids": [5, 6, 7],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 7},
            "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, None]],
            "output_token_versions": [1, 1, 2],
            "weight_version": "2",
            "cached_tokens": 16,
        },
    }
    result = result_from_sglang(response, "cell-3")
    assert result.output_ids == (5, 6, 7) and result.output_logprobs == (-0.1, -0.2, -0.3)
    assert result.output_versions == (1, 1, 2) and result.finish_reason == "stop" and result.matched_stop == 7
    assert result.cached_tokens == 16 and result.cell == "cell-3"


def test_sglang_answer_without_per_token_versions_uses_the_request_version() -> None:
    response = {
        "output_ids": [5, 6],
        "meta_info": {"finish_reason": {"type": "length", "length": 2},
                      "output_token_logprobs": [[-1.0, 5, None], [-2.0, 6, None]], "weight_version": "4"},
    }
    assert result_from_sglang(response, "c").output_versions == (4, 4)
    response["meta_info"]["weight_version"] = "default"  # SGLang before any update
    assert result_from_sglang(response, "c").output_versions == (0, 0)


def test_inconsistent_sglang_answers_are_refused() -> None:
    with pytest.raises(BackendUnavailable):
        result_from_sglang({"output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "stop"},
                                                               "output_token_logprobs": [[-1.0, 1, None]]}}, "c")
    with pytest.raises(BackendUnavailable):
        result_from_sglang({"output_ids": [], "meta_info": {"finish_reason": {"type": "exploded"}}}, "c")


def test_sampling_params_from_sglang_form() -> None:
    params = sampling_params_from_dict(
        {"max_new_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 3, "stop": ["x"], "stop_token_ids": [1, 2],
         "sampling_seed": 7}
    )
    assert (params.max_new_tokens, params.temperature, params.top_p, params.top_k) == (5, 0.5, 0.9, 3)
    assert params.stop == ("x",) and params.stop_token_ids == (1, 2) and params.seed == 7
    with pytest.raises(BackendRejected):
        sampling_params_from_dict({"max_new_tokens": 5, "frequency_penalty": 1.0})
    with pytest.raises(BackendRejected):
        sampling_params_from_dict({"top_p": 0.0})
