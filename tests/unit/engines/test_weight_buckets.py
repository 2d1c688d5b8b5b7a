"""HFBuckets and the streaming safetensors writer: the file is what safetensors itself writes and reads back, from
buckets made one at a time (each pass makes them anew), for the dtypes weights come in."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from gyre.engines.weight_buckets import HFBuckets, as_state_dict, write_safetensors


def make_buckets() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        {"model.embed_tokens.weight": torch.randn(16, 8, generator=g)},
        {"model.layers.0.mlp.up_proj.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
         "model.layers.0.input_layernorm.weight": torch.randn(8, generator=g)},
        {"lm_head.weight": torch.randn(16, 8, generator=g)[:, ::2], "empty": torch.zeros(0)},  # not contiguous
    ]


def test_streamed_buckets_make_the_file_safetensors_reads(tmp_path):
    parts = make_buckets()
    passes = []

    def make():
        passes.append(1)
        return iter(parts)

    weights = HFBuckets(make, version=4, num_buckets=3, total_bytes=0)
    written = write_safetensors(tmp_path / "model.safetensors", weights)
    got = load_file(str(tmp_path / "model.safetensors"))
    want = {k: v for bucket in parts for k, v in bucket.items()}
    assert got.keys() == want.keys()
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    assert written == sum(t.numel() * t.element_size() for t in want.values())
    whole = as_state_dict(weights)  # a second pass makes the buckets again
    assert len(passes) == 2 and all(torch.equal(whole[k], want[k]) for k in want)
    assert as_state_dict(want) is want


def test_a_name_that_comes_twice_is_refused(tmp_path):
    twice = [{"a": torch.ones(2)}, {"a": torch.zeros(2)}]
    with pytest.raises(ValueError, match="comes twice"):
        write_safetensors(tmp_path / "model.safetensors", HFBuckets(lambda: iter(twice), 0, 2, 0))
    assert not list(tmp_path.iterdir())  # no partial file, no temporary data left
