"""One rank of a two-process trainer, for test_parallel.py: run as `python3 parallel_worker.py RANK PORT OUT MODELS`.

For each layout (tensor 2, pipeline 2, data 2; tied models at tensor 2 and pipeline 2; MoE at pipeline 2, data 2 and
expert 2: data 2 with each rank holding half of the experts) it joins megatron's
parallel state over gloo, builds a MegatronTrainer, and records what the test compares with a one-process trainer:
the loss, the full gradients after the reduction, the log-probs, and the full weights after three optimizer steps,
gathered whole (`hf_state_dict`) and bucket by bucket (`iter_hf_buckets`, what a publisher sends).
Rank 0 saves the records to OUT (torch.save). MODELS is a JSON object {"untied": dir, "tied": dir, "moe": dir}.
"""

from __future__ import annotations

import json
import sys

import torch

LAYOUTS = {  # name: (model, tensor, pipeline, data, expert)
    "tp2": ("untied", 2, 1, 1, 1),
    "pp2": ("untied", 1, 2, 1, 1),
    "dp2": ("untied", 1, 1, 2, 1),
    "tied_tp2": ("tied", 2, 1, 1, 1),
    "tied_pp2": ("tied", 1, 2, 1, 1),
    "moe_pp2": ("moe", 1, 2, 1, 1),
    "moe_dp2": ("moe", 1, 1, 2, 1),
    "moe_ep2": ("moe", 1, 1, 2, 2),
}
STEPS = 3
BUCKET_BYTES = 1 << 20
"""Publishing buckets of at most 1 MiB: a decoder layer of the tiny models is 0.75-1.7 MiB, so every bucket is one
layer (or the embedding, or the final norm and output layer) and the whole model never sits in one buffer."""
LR = 1e-4  # TrainerConfig's default; see test_parallel.py on Adam and round-off


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Four right-padded rows; the data-parallel ranks take rows rank::2."""
    g = torch.Generator().manual_seed(5)
    lengths = [23, 17, 30, 9]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(0, 2041, (n,), generator=g)
    return ids, torch.tensor(lengths)


def summed_nll(logprobs: torch.Tensor):
    # A sum over tokens with a fixed divisor: additive over rows, so data-parallel halves sum to the whole batch.
    loss = -logprobs.sum() / 100.0
    return loss, {"nll": loss}


def run_layout(trainer, rank: int, data: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from gyre.engines import parallel

    ids, lengths = batch()
    logprobs = trainer.logprobs(ids, lengths)
    mine = slice(rank, None, 2) if data > 1 else slice(None)
    losses, grads = [], None
    for step in range(STEPS):
        loss = torch.tensor(trainer.forward_backward(ids[mine], lengths[mine], summed_nll)["loss"])
        if data > 1:
            dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        losses.append(float(loss))
        if step == 0:
            trainer.reduce_grads()
            flat = trainer.grads_to_flat()
            local = {s.name: flat[s.offset : s.offset + s.numel].view(s.shape) for s in trainer.param_layout()}
            grads = parallel.gather_state(local, trainer.spec)
        trainer.optimizer_step()
    weights = trainer.hf_state_dict()
    # The optimizer: elements whose moments this rank keeps (a data-parallel share with the sharded optimizer), the
    # whole moments a checkpoint holds (gathered: a collective), and that loading them back gives the same state.
    from gyre.engines.trainer import checkpoint_state_digest

    kept = sum(p.numel() for group in trainer.optimizer.param_groups for p in group["params"])
    state = trainer.checkpoint_state()
    moments = torch.cat([state["optimizer"]["state"][i][key] for key in ("exp_avg", "exp_avg_sq") for i in (0, 1)])
    trainer.load_checkpoint_state(state)
    roundtrip = checkpoint_state_digest(trainer.checkpoint_state()) == checkpoint_state_digest(state)
    buckets = list(trainer.iter_hf_buckets(bucket_bytes=BUCKET_BYTES))  # a collective: every rank iterates it
    if not trainer.is_publisher:
        assert all(not bucket for bucket in buckets), "only the publishing rank gets the weights"
    sizes = [sum(t.numel() * t.element_size() for t in bucket.values()) for bucket in buckets]
    union = {name: tensor for bucket in buckets for name, tensor in bucket.items()}
    return {"losses": losses, "grads": grads, "logprobs": logprobs, "weights": weights,
            "optimizer": {"kept": kept, "total": trainer.param_buffer().numel(), "moments": moments, "roundtrip": roundtrip},
            "buckets": {"publisher": trainer.is_publisher, "sizes": sizes, "union": union}}


def main() -> None:
    rank, port, out, models = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    torch.set_num_threads(1)
    from gyre.engines.parallel import ParallelSizes, init_parallel
    from gyre.engines.trainer import MegatronTrainer, TrainerConfig

    records = {}
    for name, (model, tensor, pipeline, data, expert) in LAYOUTS.items():
        init_parallel(rank, 2, f"tcp://127.0.0.1:{port}", ParallelSizes(tensor, pipeline, data, expert))
        trainer = MegatronTrainer(models[model], TrainerConfig(lr=LR))
        assert trainer.sizes == ParallelSizes(tensor, pipeline, data, expert)
        records[name] = run_layout(trainer, rank, data)
    if rank == 0:
        torch.save(records, out)


if __name__ == "__main__":
    main()
