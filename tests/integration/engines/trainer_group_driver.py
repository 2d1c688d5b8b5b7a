"""Rank 0 of trainer groups, for test_trainer_group.py: `python3 trainer_group_driver.py MODELS OUT LAYOUT...`
(MODELS: a JSON object {"untied": dir, "tied": dir, "moe": dir}; a layout names the model it trains).

This process is what a core cell's process is to its trainer group: rank 0, which starts the other ranks and drives
them (engines/trainer_group.py). For each layout (`LAYOUTS`) it trains STEPS optimizer steps on the samples
of `step_samples` with Gyre's loss (policies.loss, as the cell computes micro-steps), and records what the test
compares with a one-process trainer: the log-probs, each step's loss and gradient norm, the HF weights after the
steps (whole, and bucket by bucket as a publisher gets them), and a sharded checkpoint's round trip (saved after the
steps, one more step taken, restored: the digests of weights and AdamW moments, and the weights), a
publication (a snapshot taken, a step applied, the snapshot streamed into a safetensors file), and every rank's shard
as a peer pulls it from the host copy a core serves where its agent cannot register the weights (`ServedShards`:
after the steps, after one more step, after the restore and after a load by name). "kill" starts a
tensor-parallel group, kills rank 1 and records the error the next micro-step raises; "bad_start" records the
errors of groups whose worker exits at start or never answers. Saves the records (torch.save).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import tempfile

import torch

from gyre.messages.samples import TrainingSample
from gyre.policies.loss import loss_from_samples, pack_samples

STEPS = 3
LR = 5e-5
"""Adam moves an element whose gradient is near zero by about lr whatever its size, so the 1e-7 round-off between a
tensor-parallel sum and a one-process one can flip such a move (see test_parallel.py): at 1e-4 the weights after three
GSPO steps differ by 1.1e-5, at 5e-5 by half that."""
BUCKET_BYTES = 1 << 20
LAYOUTS = {  # name: (model, tensor, pipeline, data, expert)
    "tp2": ("untied", 2, 1, 1, 1), "pp2": ("untied", 1, 2, 1, 1), "dp2": ("untied", 1, 1, 2, 1),
    "tied_tp2": ("tied", 2, 1, 1, 1), "moe_dp2": ("moe", 1, 1, 2, 1),
    # Expert parallel: two ranks with four experts each; four ranks, two expert groups of two, each expert on two.
    "moe_ep2": ("moe", 1, 1, 2, 2), "moe_dp4_ep2": ("moe", 1, 1, 4, 2), "moe_pp2_ep2": ("moe", 1, 2, 2, 2),
}


def sample(index: int, step: int, length: int) -> TrainingSample:
    g = torch.Generator().manual_seed(1000 * step + index)
    ids = tuple(int(t) for t in torch.randint(1, 2000, (length,), generator=g))
    mask = tuple(t >= length // 3 for t in range(length))
    k = sum(mask)
    advantage = float(torch.randn((), generator=g))
    return TrainingSample(
        execution_id=f"e{step}-{index}", group_id=f"g{step}", trajectory_rank=0, trajectory_kind="main",
        leaf_call_index=0, token_ids=ids, loss_mask=mask, behaviour_logprobs=tuple(-7.0 if m else 0.0 for m in mask),
        advantages=(advantage,) * length, weights=tuple(1.0 / k if m else 0.0 for m in mask), min_weight_version=0,
        max_weight_version=0, num_loss_tokens=k, sampling_temperatures=(1.0,) * length,
    )


def step_samples(step: int) -> list[TrainingSample]:
    return [sample(i, step, n) for i, n in enumerate((9, 17, 23, 30))]


def share(rows: list[TrainingSample], num_executions: int):
    if not rows:
        return None
    batch = pack_samples(rows)
    # Wide clips: the ratio is far from 1 (behaviour log-probs are made up), and clipped tokens carry no gradient.
    loss_fn = functools.partial(loss_from_samples, batch=batch, num_executions=num_executions, clip_low=0.9,
                                clip_high=10.0)
    return batch.input_ids, batch.lengths, loss_fn, batch.temperatures


def train(trainer, data: int) -> dict:
    """What both sides run: STEPS steps, each one micro-step of four samples (data replicas: rows dealt round-robin)."""
    probe = pack_samples(step_samples(99))
    out = {"logprobs": trainer.logprobs(probe.input_ids, probe.lengths), "losses": [], "grad_norms": []}
    for step in range(STEPS):
        rows = step_samples(step)
        if data == 1:
            metrics = [trainer.forward_backward(*share(rows, len(rows)))]
        else:
            metrics = [m for m in trainer.forward_backward_shares([share(rows[r::data], len(rows))
                                                                   for r in range(data)]) if m is not None]
        out["losses"].append(sum(m["loss"] for m in metrics))
        result = trainer.optimizer_step()
        assert not result["skipped"]
        out["grad_norms"].append(result["grad_norm"])
    out["weights"] = trainer.hf_state_dict()
    out["num_params"] = trainer.num_params
    return out


class ServedShards:
    """Every rank's shard served as a core serves device weights on a Mooncake build without CUDA: rank 0's agent
    cannot register the parameters (this machine has no GPU, so host memory stands in for device memory), so rank 0
    serves a host copy (ServedParams "copy") and the workers follow it; a second agent pulls each shard as a peer
    does, to compare it with the rank's weights."""

    def __init__(self, group) -> None:
        from gyre.engines.trainer_group import ServedParams
        from gyre.engines.transfer import TransferAgent

        class CannotRegisterLargeBuffers(TransferAgent):
            def can_register(self, buffer) -> bool:
                return buffer.numel() <= 1

        self.group = group
        self.agent = CannotRegisterLargeBuffers()
        params = group.param_buffer()
        self.served = ServedParams(params, self.agent, ServedParams.choose(params, self.agent, serve=True),
                                   group.version)
        self.sources = group.shard_sources(self.agent, self.served)
        self.reader = TransferAgent()
        self.into = [torch.zeros(nbytes // 4) for _, _, nbytes in self.sources]
        for tensor in self.into:
            self.reader.register_tensor(tensor)

    def pull(self) -> list[torch.Tensor]:
        """Every rank's served shard, as a peer reads it now."""
        for (peer, addr, _), into in zip(self.sources, self.into):
            self.reader.pull_tensor(peer, addr, into)
        return [tensor.clone() for tensor in self.into]

    def diffs(self, want: list[torch.Tensor]) -> list[float]:
        """Per rank: the largest difference between its served shard and `want[rank]`."""
        return [float((got - w).abs().max()) for got, w in zip(self.pull(), want)]

    def close(self) -> None:
        self.served.close()
        self.agent.close()
        self.reader.close()


def saved_shards(group, path: str) -> list[torch.Tensor]:
    """Every rank's flat weights as its part of the committed checkpoint at `path` holds them."""
    import io

    from gyre.runtime.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(path)
    out = []
    for rank in group.ranks:
        name = f"core.tp{rank['tensor']}.pp{rank['pipeline']}"
        name += f".ep{rank['expert']}.pt" if group.sizes.expert > 1 else ".pt"
        out.append(torch.load(io.BytesIO(checkpoint.read_part(name)), weights_only=True)["params"])
    return out


def run_layout(model_dir: str, name: str, workdir: str) -> dict:
    from gyre.engines.trainer import TrainerConfig
    from gyre.engines.trainer_group import TrainerGroup
    from safetensors.torch import load_file

    from gyre.engines.weight_buckets import write_safetensors
    from gyre.runtime.checkpoint import commit, staging_dir

    _, tensor, pipeline, data, expert = LAYOUTS[name]
    group = TrainerGroup(model_dir, TrainerConfig(lr=LR, num_threads=1, tensor_parallel=tensor,
                                                  pipeline_parallel=pipeline, data_parallel=data,
                                                  expert_parallel=expert))
    served = ServedShards(group)
    try:
        out = train(group, data)
        out["ranks"], out["lane_numels"] = group.ranks, list(group.lane_numels)
        buckets = list(group.iter_hf_buckets(bucket_bytes=BUCKET_BYTES))
        out["buckets"] = {"sizes": [sum(t.numel() * t.element_size() for t in b.values()) for b in buckets],
                          "union": {k: v for b in buckets for k, v in b.items()}}
        root = os.path.join(workdir, name)
        records, saved_digest = group.save_sharded_checkpoint(staging_dir(root, 0))
        path = commit(root, 0, {r.name: r for r in records}, {"weight_version": group.version}, keep=2)
        saved_version = group.version
        saved = saved_shards(group, path)
        checks = {"how": served.served.how, "sizes": [nbytes for _, _, nbytes in served.sources],
                  "copy_apart": served.served.buffer.data_ptr() != group.param_buffer().data_ptr(),
                  "after_steps": served.diffs(saved)}
        group.forward_backward(*share(step_samples(7), 4))
        group.optimizer_step()
        checks["after_step_moved"] = served.diffs(saved)
        checks["after_step_rank0"] = served.diffs([group.param_buffer()])[0]
        moved = group.hf_state_dict()
        restored_digest = group.load_sharded_checkpoint(path)
        checks["after_restore"] = served.diffs(saved)
        out["checkpoint"] = {"parts": sorted(r.name for r in records), "saved_digest": saved_digest,
                             "restored_digest": restored_digest, "moved": moved, "restored": group.hf_state_dict(),
                             "saved_version": saved_version, "restored_version": group.version}
        # Publishing as the core does (actors/cells/rollout_role.py): a snapshot under the lock, gathered later by
        # the disk writer, bucket by bucket; a step in between does not change what it publishes.
        publication = group.publication(bucket_bytes=BUCKET_BYTES)
        group.forward_backward(*share(step_samples(9), 4))
        group.optimizer_step()
        target = os.path.join(workdir, f"{name}.safetensors")
        write_safetensors(target, publication)
        out["publication"] = {"version": publication.version, "file": load_file(target),
                              "sizes": [sum(t.numel() * t.element_size() for t in b.values()) for b in publication],
                              "num_buckets": publication.num_buckets, "total_bytes": publication.total_bytes}
        # New weights by name: each rank gets only its shard of them.
        group.load_hf_state_dict(out["weights"], version=11)
        out["loaded"] = {"weights": group.hf_state_dict(), "version": group.version}
        checks["after_load"] = served.diffs(saved)  # the weights of the three steps again, after another step
        out["served"] = checks
    finally:
        served.close()
        group.close()
    return out


def run_kill(model_dir: str) -> dict:
    from gyre.engines.trainer import TrainerConfig
    from gyre.engines.trainer_group import TrainerGroup, TrainerGroupError

    group = TrainerGroup(model_dir, TrainerConfig(lr=LR, num_threads=1, tensor_parallel=2))
    try:
        group.forward_backward(*share(step_samples(0), 4))
        os.kill(group._procs[0].pid, signal.SIGKILL)
        try:
            group.forward_backward(*share(step_samples(1), 4))
        except TrainerGroupError as error:
            first = str(error)
        else:
            first = ""
        try:
            group.optimizer_step()
        except TrainerGroupError as error:
            second = str(error)
        else:
            second = ""
    finally:
        group.close()
    return {"first": first, "second": second}


def run_bad_starts(model_dir: str, workdir: str) -> dict:
    """Workers that cannot start: one exits at once saying why, one never answers (a start timeout of 3 s)."""
    from gyre.engines.trainer import TrainerConfig
    from gyre.engines.trainer_group import TrainerGroup, TrainerGroupError

    out = {}
    for name, body in (("exits", "echo 'no device for this rank' >&2; exit 3"), ("hangs", "exec sleep 600")):
        fake_python = os.path.join(workdir, f"python-{name}")
        with open(fake_python, "w") as handle:
            handle.write(f"#!/bin/sh\n{body}\n")
        os.chmod(fake_python, 0o755)
        try:
            TrainerGroup(model_dir, TrainerConfig(tensor_parallel=2, group_start_timeout_s=3.0), python=fake_python)
        except TrainerGroupError as error:
            out[name] = str(error)
        else:
            out[name] = ""
    return out


def main() -> None:
    models, out, layouts = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3:]
    model_dir = models["untied"]
    torch.set_num_threads(1)
    records = {}
    with tempfile.TemporaryDirectory() as workdir:
        for name in layouts:
            if name == "kill":
                records[name] = run_kill(model_dir)
            elif name == "bad_start":
                records[name] = run_bad_starts(model_dir, workdir)
            else:
                records[name] = run_layout(models[LAYOUTS[name][0]], name, workdir)
    torch.save(records, out)


if __name__ == "__main__":
    main()
