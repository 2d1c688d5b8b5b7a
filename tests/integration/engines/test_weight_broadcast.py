"""Weights by broadcast into a real engine server process: init_weights_update_group + update_weights_from_distributed
over gloo, the sender side being the same `BroadcastSender` a cell uses (and a trainer would, with nccl on GPUs).

Checked: after a bucketed broadcast of another model's weights the server generates exactly what an engine loaded
from that model's directory generates, and tags tokens with the version sent; a group can be destroyed and formed
again; wrong requests are 400s that name the fault; a sender whose server went away gets WeightGroupError."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from gyre.engines.async_engine import AsyncEngine
from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig, SamplingParams
from gyre.engines.model_format import init_model_dir, load_hf_state_dict
from gyre.engines.sglang_client import RequestRejected, SGLangClient
from gyre.engines.weight_broadcast import BroadcastSender, WeightGroupError, buckets
from gyre.engines.weight_buckets import HFBuckets

PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> Path:
    return init_model_dir(tmp_path_factory.mktemp("other"), preset="tiny", seed=7)


def reference_output(model_dir: Path) -> list[int]:
    """Greedy output of an engine that loaded `model_dir` from disk."""
    async def generate() -> list[int]:
        engine = AsyncEngine(EmbeddedEngine(model_dir, EngineConfig(num_blocks=32, max_context_tokens=256,
                                                                    num_threads=1)))
        try:
            out = await engine.generate("ref", PROMPT, SamplingParams(max_new_tokens=8, temperature=0.0,
                                                                      ignore_eos=True))
        finally:
            await engine.close()
        return list(out.output_ids)

    return asyncio.run(generate())


def test_a_bucketed_broadcast_loads_another_model_into_a_server(tiny_model_dir, other_model, tmp_path,
                                                                 engine_servers):
    weights = load_hf_state_dict(other_model)
    assert len(list(buckets(weights, 64 * 1024))) > 3  # several buckets, several HTTP calls

    async def drive(url: str) -> tuple:
        async with SGLangClient(url) as client:
            before = await client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True})
            sender = BroadcastSender([client], "127.0.0.1", bucket_bytes=64 * 1024, timeout_s=60)
            sent = await sender.send(weights, version=5)
            after = await client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True})
            info = await client.model_info()
            first_group = sender.group_name
            await sender.close()  # destroyed on both sides; the next send forms a new group
            with pytest.raises(RequestRejected, match="no weight-update group"):
                await client.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[128]],
                                                             first_group)
            await sender.send(weights, version=6)
            second_group = sender.group_name
            await sender.close()
            return before, after, info, sent, first_group, second_group

    with engine_servers(tiny_model_dir, tmp_path, {"engine": []}) as urls:
        before, after, info, sent, first, second = asyncio.run(drive(urls["engine"]))
    assert sent == sum(t.numel() * t.element_size() for t in weights.values())
    assert after["output_ids"] == reference_output(other_model)
    assert before["output_ids"] == reference_output(tiny_model_dir) != after["output_ids"]
    assert after["meta_info"]["output_token_versions"] == [5] * 8
    assert info["weight_version"] == 5
    assert first != second


def test_buckets_gathered_one_at_a_time_broadcast_like_a_state_dict(tiny_model_dir, other_model, tmp_path,
                                                                    engine_servers):
    """HFBuckets (a sharded trainer's version, engines/weight_buckets.py): each bucket is made only when the
    broadcast reaches it, and the server ends up with the same model as from the whole state dict."""
    weights = load_hf_state_dict(other_model)
    names = list(weights)
    parts = [{n: weights[n] for n in names[i::3]} for i in range(3)]
    made = []

    def make():
        for part in parts:
            made.append(len(made))
            yield part

    async def drive(url: str) -> tuple:
        async with SGLangClient(url) as client:
            sender = BroadcastSender([client], "127.0.0.1", bucket_bytes=64 * 1024, timeout_s=60)
            sent = await sender.send(HFBuckets(make, 3, len(parts), 0), version=3)
            after = await client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True})
            await sender.close()
            return sent, after

    with engine_servers(tiny_model_dir, tmp_path, {"engine": []}) as urls:
        sent, after = asyncio.run(drive(urls["engine"]))
    assert made == [0, 1, 2]
    assert sent == sum(t.numel() * t.element_size() for t in weights.values())
    assert after["output_ids"] == reference_output(other_model)
    assert after["meta_info"]["output_token_versions"] == [3] * 8


def test_broadcast_requests_that_cannot_work_are_refused(tiny_model_dir, tmp_path, engine_servers):
    async def drive(url: str) -> list[str]:
        messages = []
        async with SGLangClient(url) as client:
            for call in (
                client.init_weights_update_group("127.0.0.1", 29999, 1, 2, "g", "nccl"),  # a CPU engine
                client.init_weights_update_group("127.0.0.1", 29999, 0, 2, "g", "gloo"),  # rank 0 is the sender
                client.init_weights_update_group("127.0.0.1", 29999, 1, 2, "g", "mpi"),
                client.update_weights_from_distributed(["x"], ["float32"], [[1]], "never-formed"),
            ):
                with pytest.raises(RequestRejected) as refused:
                    await call
                messages.append(refused.value.message)
            # A group formed, then a bucket naming a dtype nobody knows.
            sender = BroadcastSender([client], "127.0.0.1", timeout_s=30)
            await sender.connect()
            with pytest.raises(RequestRejected) as refused:
                await client.update_weights_from_distributed(["x"], ["float8"], [[1]], sender.group_name)
            messages.append(refused.value.message)
            await sender.close()
        return messages

    with engine_servers(tiny_model_dir, tmp_path, {"engine": []}) as urls:
        messages = asyncio.run(drive(urls["engine"]))
    assert "use backend gloo" in messages[0]
    assert "rank_offset" in messages[1]
    assert "gloo or nccl" in messages[2]
    assert "no weight-update group 'never-formed'" in messages[3]
    assert "unknown dtype 'float8'" in messages[4]


def test_a_bucket_the_server_refuses_fails_at_once_and_the_next_update_forms_a_new_group(
        tiny_model_dir, other_model, tmp_path, engine_servers):
    weights = load_hf_state_dict(other_model)

    async def drive(url: str) -> tuple:
        async with SGLangClient(url) as client:
            sender = BroadcastSender([client], "127.0.0.1", timeout_s=20)
            await sender.connect()
            first = sender.group_name
            refused = {"model.norm.weight": weights["model.norm.weight"].to(torch.float8_e4m3fn)}
            with pytest.raises(WeightGroupError, match="unknown dtype 'float8_e4m3fn'"):
                await sender.send(refused, version=3)  # the server's 400 ends it, not the broadcast's timeout
            connected_after = sender.connected
            await sender.send(weights, version=4)
            second = sender.group_name
            after = await client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True})
            await sender.close()
            return first, second, connected_after, after

    with engine_servers(tiny_model_dir, tmp_path, {"engine": []}) as urls:
        first, second, connected_after, after = asyncio.run(drive(urls["engine"]))
    assert not connected_after and first != second
    assert after["output_ids"] == reference_output(other_model)
    assert after["meta_info"]["output_token_versions"] == [4] * 8


def test_a_sender_whose_server_is_gone_gets_a_weight_group_error() -> None:
    async def drive() -> None:
        async with SGLangClient("http://127.0.0.1:9") as client:  # nothing listens on the discard port
            sender = BroadcastSender([client], "127.0.0.1", timeout_s=5)
            with pytest.raises(WeightGroupError, match="could not form"):
                await sender.send({"w": torch.zeros(4)}, version=1)
            assert not sender.connected

    asyncio.run(drive())


def test_buckets_keep_order_and_bound_their_bytes() -> None:
    weights = {f"t{i}": torch.zeros(n) for i, n in enumerate([10, 10, 30, 5, 100, 1])}  # fp32: 4 bytes each
    got = list(buckets(weights, bucket_bytes=80))
    assert got == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]  # t4 (400 bytes) alone; order kept
    assert [n for bucket in got for n in bucket] == list(weights)
