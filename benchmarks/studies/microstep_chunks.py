"""Forward/backward time of logged micro-steps, padded as one batch vs in length-sorted chunks.

    python benchmarks/studies/microstep_chunks.py REPORT/events.glog --model-dir MODEL --microsteps 4

Reads the first `--microsteps` ClaimGranted messages that carry samples from a run's event log and times each on one
trainer thread: as one batch padded to its longest sample, and as `policies.loss.length_sorted_chunks` of 4,096
and 2,048 padded tokens (what `TrainerHost.compute` does). It also reports the largest gradient difference against
the padded batch, relative to the largest gradient, which should be ~1e-6 (float32 sums in another order).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from gyre.engines.trainer import MegatronTrainer, TrainerConfig
from gyre.policies.loss import length_sorted_chunks, loss_from_samples, pack_samples
from gyre.runtime.codec import Codec
from gyre.runtime.event_log import read_log


def _grants(log_path: str, count: int) -> list:
    codec, grants = Codec(), []
    for record in read_log(log_path):
        if record.type_name.endswith("ClaimGranted"):
            grant = record.decode(codec)
            if grant.samples:
                grants.append(grant)
                if len(grants) == count:
                    break
    return grants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="a run's events.glog")
    parser.add_argument("--model-dir", required=True, help="the model the run trained (its prepare.json names it)")
    parser.add_argument("--microsteps", type=int, default=4)
    args = parser.parse_args(argv)
    trainer = MegatronTrainer(args.model_dir, TrainerConfig(num_threads=1))

    def run(samples, chunk_tokens: int | None) -> float:
        trainer.zero_grads()
        started = time.perf_counter()
        for chunk in length_sorted_chunks(samples, chunk_tokens) if chunk_tokens else [list(samples)]:
            batch = pack_samples(chunk)
            trainer.forward_backward(batch.input_ids, batch.lengths,
                                     lambda lp, batch=batch: loss_from_samples(lp, batch, num_executions=64),
                                     batch.temperatures)
        return time.perf_counter() - started

    for grant in _grants(args.log, args.microsteps):
        run(grant.samples, None)  # warm-up
        row = {"samples": len(grant.samples), "tokens": sum(len(s.token_ids) for s in grant.samples)}
        row["padded_s"] = round(run(grant.samples, None), 3)
        reference = trainer.grads_to_flat().clone()
        for chunk_tokens in (4096, 2048):
            row[f"chunks_{chunk_tokens}_s"] = round(run(grant.samples, chunk_tokens), 3)
            difference = (trainer.grads_to_flat() - reference).abs().max() / reference.abs().max()
            row[f"chunks_{chunk_tokens}_grad_rel_diff"] = float(difference)
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
