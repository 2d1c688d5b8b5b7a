"""What a cell's trainer costs the CPU besides its arithmetic: malloc's handling of freed tensors, and the threads
of the process groups megatron's parallel state makes.

    python benchmarks/studies/trainer_cpu.py --chunks 6 --malloc default   # then --malloc keep, and compare
    python benchmarks/studies/trainer_cpu.py --chunks 0 --idle-s 10 --gloo per-group   # then --gloo shared

In a fresh process (malloc settings and process groups are process-wide), on a worker thread as the cell runs its
trainer: `--chunks` forward/backward passes of a MegatronTrainer on examples/warm_start, each a chunk of ~2,048
padded tokens (rows of 150-640 tokens, as the main job's micro-steps are cut), seeded, so the gradients' digest
shows whether two settings computed the same numbers. `--malloc keep` calls
engines/host_memory.keep_freed_tensor_memory first (what TrainerHost.build does); `default` leaves malloc alone.
`--gloo per-group` gives every process group a gloo device of its own (torch's default, undoing megatron_cpu's shim
10); `shared` keeps the shim. Then `--idle-s` seconds of sleep show what the process burns doing nothing.
Prints one JSON line: user and system CPU-s and minor page faults of the chunks, the gradients' digest, the gloo loop
threads, and the idle CPU-s and voluntary context switches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import sys
import threading
import time
from pathlib import Path

WARM_START = Path(__file__).resolve().parents[2] / "examples" / "warm_start"


def _usage() -> tuple[float, float, int, int]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime, usage.ru_minflt, usage.ru_nvcsw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=6, help="forward/backward passes of ~2,048 tokens")
    parser.add_argument("--malloc", choices=("default", "keep"), default="keep")
    parser.add_argument("--gloo", choices=("shared", "per-group"), default="shared")
    parser.add_argument("--idle-s", type=float, default=0.0, help="seconds of doing nothing, measured")
    args = parser.parse_args(argv)
    import torch

    from gyre.engines import megatron_cpu
    from gyre.engines.host_memory import keep_freed_tensor_memory

    if args.malloc == "keep" and not keep_freed_tensor_memory():
        raise SystemExit("trainer_cpu: malloc could not be set here (no glibc)")
    megatron_cpu.apply()
    if args.gloo == "per-group":
        from torch.distributed import distributed_c10d

        distributed_c10d.ProcessGroupGloo = distributed_c10d.ProcessGroupGloo.__mro__[1]  # torch's own class
    from gyre.engines.trainer import MegatronTrainer, TrainerConfig

    result: dict = {"malloc": args.malloc, "gloo": args.gloo}

    def work() -> None:
        trainer = MegatronTrainer(WARM_START, TrainerConfig(num_threads=1, lr=3e-4))
        rng = random.Random(0)
        torch.manual_seed(0)
        chunks = []
        for _ in range(args.chunks + 1):
            length = rng.randrange(150, 640)
            rows = max(1, 2048 // length)
            chunks.append((torch.randint(0, 2000, (rows, length)), torch.full((rows,), length)))

        def loss(logprobs):
            return logprobs.sum() * 1e-6, {}

        trainer.forward_backward(*chunks[0], loss)  # first pass: lazy set-up, not counted
        before = _usage()
        for ids, lengths in chunks[1:]:
            trainer.forward_backward(ids, lengths, loss)
        after = _usage()
        result.update(user_cpu_s=round(after[0] - before[0], 3), system_cpu_s=round(after[1] - before[1], 3),
                      minor_faults=after[2] - before[2],
                      grads_digest=hashlib.sha256(trainer.grads_to_flat().numpy().tobytes()).hexdigest()[:16])

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    result["gloo_loop_threads"] = names.count("gloo_tcp_loop")
    if args.idle_s > 0:
        before = _usage()
        time.sleep(args.idle_s)
        after = _usage()
        result.update(idle_cpu_s=round(after[0] - before[0] + after[1] - before[1], 3),
                      idle_voluntary_switches=after[3] - before[3])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
