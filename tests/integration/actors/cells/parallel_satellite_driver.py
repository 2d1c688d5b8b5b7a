"""A satellite whose trainer spans processes joins a parallel core's step, for test_parallel_satellite.py:
`python3 parallel_satellite_driver.py MODEL OUT LAYOUT` (LAYOUT: tp2, dp2, or moe_ep2 for a MoE model: data 2 and
expert 2, each rank half of the experts).

This process is the core cell's: its TrainerHost (the cell's trainer side, actors/cells/train_role.py) holds a
TrainerGroup of two processes over gloo, real Mooncake agents register its buffers. It first trains one step alone
(every micro-step of the step on the core: the reference), then, with a fresh core, the same step with a satellite
cell's host of the same layout in another process (`satellite` below, started here at once, so its start overlaps
the reference's; it computes its micro-step from the same initial weights): the core computes micro-step
0, the satellite micro-step 1, a reduction round (the calls CoreSteps and ClaimLoop make: reduce_as_core,
reduce_as_member with the JoinReduction the core sends, add_reduced) brings the satellite's shards in lane by lane,
and the core applies the step. Then the core sends the satellite the JoinReduction of a one-process core: it
refuses with GradientBufferError before any byte moves; and the satellite catches up on the new weights as a cell
does (TrainerHost.pull of the core's WeightSource: every rank pulls its shard from the core's rank of the same place
between two reads of the core's fence; a stale version is refused). Records (torch.save): each run's loss, gradient
norm and HF weights, the round's bytes, the lanes' sizes, the refusal and the pulls.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import attrs
import torch

from gyre.messages.cell_internal import WeightSource
from gyre.messages.gradient_rounds import GradientsHeld, JoinReduction
from gyre.messages.samples import TrainingSample

LR = 5e-5  # see tests/integration/engines/trainer_group_driver.py on Adam and round-off
LAYOUTS = {"tp2": dict(tensor_parallel=2), "dp2": dict(data_parallel=2),
           "moe_ep2": dict(data_parallel=2, expert_parallel=2)}
MICROSTEPS = 2
"""Micro-steps of the step: 0 on the core, 1 on the satellite (the reference computes both on the core)."""


def sample(index: int, length: int) -> TrainingSample:
    g = torch.Generator().manual_seed(700 + index)
    ids = tuple(int(t) for t in torch.randint(1, 2000, (length,), generator=g))
    mask = tuple(t >= length // 3 for t in range(length))
    k = sum(mask)
    advantage = float(torch.randn((), generator=g))
    return TrainingSample(
        execution_id=f"e{index}", group_id="g", trajectory_rank=0, trajectory_kind="main", leaf_call_index=0,
        token_ids=ids, loss_mask=mask, behaviour_logprobs=tuple(-7.0 if m else 0.0 for m in mask),
        advantages=(advantage,) * length, weights=tuple(1.0 / k if m else 0.0 for m in mask), min_weight_version=0,
        max_weight_version=0, num_loss_tokens=k, sampling_temperatures=(1.0,) * length,
    )


def microstep(index: int) -> list[TrainingSample]:
    """Two samples each (a data-parallel trainer deals one to each replica)."""
    return [sample(2 * index, 11 + 7 * index), sample(2 * index + 1, 19 + 5 * index)]


NUM_EXECUTIONS = 2 * MICROSTEPS


def config(layout: str):
    from gyre.engines.trainer import TrainerConfig

    return TrainerConfig(lr=LR, num_threads=1, **LAYOUTS[layout])


def host(model_dir: str, layout: str, is_core: bool):
    from gyre.actors.cells.train_role import TrainerHost
    from gyre.engines.transfer import TransferAgent

    agent = TransferAgent()
    fence_scratch = torch.zeros(1, dtype=torch.int64)
    agent.register_tensor(fence_scratch)
    return TrainerHost.build(model_dir, config(layout), agent, is_core, fence_scratch), agent


def compute_microstep(trainer_host, index: int) -> dict:
    return trainer_host.compute(microstep(index), NUM_EXECUTIONS, 0.9, 10.0, 4096)


def applied(trainer_host, metrics: list[dict], result: dict) -> dict:
    return {"loss": sum(m["loss"] for m in metrics), "grad_norm": result["grad_norm"], "skipped": result["skipped"],
            "version": trainer_host.version, "weights": trainer_host.trainer.hf_state_dict()}


def alone(model_dir: str, layout: str) -> dict:
    core, agent = host(model_dir, layout, is_core=True)
    try:
        metrics = [compute_microstep(core, i) for i in range(MICROSTEPS)]
        return applied(core, metrics, core.apply_step())
    finally:
        core.close()
        agent.close()


MARK = "satellite> "
"""Starts the satellite's replies on its stdout (its logs go there too)."""


def hear(satellite: subprocess.Popen) -> dict:
    for line in satellite.stdout:
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"the satellite exited with code {satellite.wait()} before it answered")


def tell(satellite: subprocess.Popen, msg: JoinReduction | WeightSource) -> None:
    satellite.stdin.write(json.dumps([type(msg).__name__, attrs.asdict(msg)]) + "\n")
    satellite.stdin.flush()


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def weights_digest(trainer_host) -> str:
    weights = trainer_host.trainer.hf_state_dict()
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode() + weights[name].numpy().tobytes())
    return digest.hexdigest()


def start_satellite(model_dir: str, layout: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, model_dir, "-", layout, "satellite"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def with_satellite(model_dir: str, layout: str, satellite: subprocess.Popen) -> dict:
    from gyre.actors.cells.train_role import decode_held

    core, agent = host(model_dir, layout, is_core=True)
    try:
        metrics = [compute_microstep(core, 0)]
        assert hear(satellite)["held"] == 1  # it computed micro-step 1
        join = JoinReduction(1, 1, 1, 2, core.address, core.rendezvous.port, core.numel, core.layout,
                             core.lane_numels)
        tell(satellite, join)
        moved, payloads = core.reduce_as_core(join.round_id, join.group_id, join.size)
        counted = decode_held("satellite", payloads[0])
        joined = hear(satellite)
        core.add_reduced()
        # A core of one process asks it to join: refused before any byte moves (the core's side is not run).
        tell(satellite, JoinReduction(2, 2, 1, 2, core.address, core.rendezvous.port, 1000, (1, 1, 1, 1), (1000,)))
        refused = hear(satellite)
        metrics.append({"loss": counted[0].loss})
        out = applied(core, metrics, core.apply_step())
        # The satellite catches up as a cell does (TrainerHost.pull of the core's WeightSource): every rank its shard.
        source = core.source("core")
        tell(satellite, attrs.evolve(source, version=0))  # the core moved on: never passes for version 0
        stale = hear(satellite)
        tell(satellite, source)
        pulled = hear(satellite)
        out.update(stale=stale, pulled=pulled, core_digest=weights_digest(core), shards=list(source.shards),
                   source_layout=list(source.layout))
        out.update(refused=refused, joined=joined, core_received=moved.received, core_sent=moved.sent,
                   counted=[(d.step_id, d.microstep_index, d.num_tokens) for d in counted],
                   lane_numels=list(core.lane_numels), layout=list(core.layout))
        return out
    finally:
        satellite.stdin.close()
        satellite.wait(timeout=120)
        core.close()
        agent.close()


def satellite_main(model_dir: str, layout: str) -> None:
    """The satellite cell's side: compute micro-step 1 into its trainer, then join every round it is sent."""
    from gyre.actors.cells.train_role import GradientBufferError, encode_held
    from gyre.actors.cells.weight_pull import StaleWeights
    from gyre.engines.grad_exchange import ReductionMember

    torch.set_num_threads(1)
    sat, agent = host(model_dir, layout, is_core=False)
    member = ReductionMember("cpu", 120.0)
    try:
        metrics = compute_microstep(sat, 1)
        held = [GradientsHeld("satellite", 0, 1, int(metrics["num_tokens"]), float(metrics["loss"]), 0)]
        print(MARK + json.dumps({"held": len(held)}), flush=True)
        for line in sys.stdin:
            kind, fields = json.loads(line)
            if kind == "WeightSource":
                try:
                    moved = sat.pull(WeightSource(**{k: _tuples(v) for k, v in fields.items()}))
                except StaleWeights as error:
                    print(MARK + json.dumps({"error": str(error), "version": sat.version}), flush=True)
                    continue
                print(MARK + json.dumps({"moved": moved, "version": sat.version, "digest": weights_digest(sat)}),
                      flush=True)
                continue
            join = JoinReduction(**{k: _tuples(v) for k, v in fields.items()})
            try:
                moved = sat.reduce_as_member(member, join, encode_held(held))
            except GradientBufferError as error:
                print(MARK + json.dumps({"error": str(error)}), flush=True)
                continue
            print(MARK + json.dumps({"sent": moved.sent, "received": moved.received}), flush=True)
    finally:
        member.drop()
        sat.close()
        agent.close()


def main() -> None:
    model_dir, out, layout = sys.argv[1:4]
    torch.set_num_threads(1)
    if sys.argv[4:] == ["satellite"]:
        satellite_main(model_dir, layout)
        return
    satellite = start_satellite(model_dir, layout)  # its start overlaps the reference run
    try:
        records = {"alone": alone(model_dir, layout)}
    except BaseException:
        satellite.kill()
        raise
    records["joined"] = with_satellite(model_dir, layout, satellite)
    torch.save(records, out)


if __name__ == "__main__":
    main()
