"""The train role of a cell: its trainer and shared buffers, the claim loop, and the core's step bookkeeping.

Gradient exchange, end to end:
- every train-role cell runs a claim loop: ClaimMicroStep -> forward/backward on the granted samples (the loss
  normalised by the whole step's execution count, so summed micro-steps give the step's mean) -> report;
- the core's own gradients accumulate straight into its trainer and it reports `MicroStepDone(grad_peer="")` to
  itself, which it forwards to the claimer; a micro-step the core computes is reserved before its compute starts,
  because its gradients land in the trainer as they are computed and could not be taken out again;
- a satellite's gradients accumulate in its own trainer, micro-step after micro-step; it notes each one under its
  compute lock and tells the core `GradientsHeld` (no bytes move);
- a *reduction round* (engines/grad_exchange.py) brings them in: when the lowest open step has every micro-step
  done, in compute on the core or held by a satellite, or when a satellite leaves training (`FlushGradients`), the
  core asks the holders to `JoinReduction`; each leaves its list of held micro-steps in the core's rendezvous store
  and reduces its buffer over a torch.distributed group (gloo on CPU, NCCL on CUDA) into the core, and zeroes it.
  The core receives one buffer's worth of bytes (S) and each satellite sends S, however many join; a parameter
  server would receive S per satellite. The core counts exactly the members' lists (micro-steps whose
  GradientsHeld is still on the bus included), forwards each as MicroStepDone to the claimer, adds the sum to its
  gradients, and tells every member `RoundEnded`;
- a round that fails (a member dead, slow past the group's timeout, a bad list) or whose lists overlap each other or
  what is in already (the claimer re-queued a micro-step a satellite still held: a buffer cannot give one
  micro-step back) counts nothing: each member hands what it brought back with `ReleaseMicroStep` on
  `RoundEnded(counted=False)`, and it is trained again. A GradientsHeld older than the satellite's last round is
  void (that round counted it or handed it back);
- membership: a round's group is the core plus the satellites it names; the group is formed when a membership is
  new (a satellite joined training, one left, or the last round failed) and reused while it holds;
- when the claimer's `StepReady` has fixed the step's size and all its micro-steps are in, the core runs the
  optimizer step (fence -1 while it writes, see actors/cells/weight_pull.py) and publishes `StepApplied`; the broker
  announces the new weights;
- a step whose summed gradients are not finite is skipped by the trainer (weights and version unchanged). It is still
  announced, as `StepApplied(skipped=True)` with the unchanged version: the step is over and its samples are used
  up, so the claimer moves to the next step (same base version), the task source's gate counts the step (it counts
  steps, not versions) and the broker publishes nothing (no new weights). Bumping the version instead would tag
  identical weights as new and make every rollout engine reload them.
A cell can only claim micro-steps whose base version equals its weights (the claimer enforces it), so no gradient
buffer ever mixes two steps.

Who does what: `TrainerHost`, `CoreSteps` and `ClaimLoop` never see the cell. They take explicit inputs (values,
`ClaimSettings`, the cell's compute lock, `offload`/`send`/`ask` callables, the trainer host) and return results;
the cell (actors/cells/cell.py) owns all state and sequences: it runs the claim loop, publishes each StepApplied
`CoreSteps.apply_next` returns, and decides what follows a step (its engine's weights, a checkpoint).
`StepTracker` is the core's ledger of micro-steps, with no I/O.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import json
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import attrs
import structlog
import torch

from gyre.actors.cells.weight_pull import pull_weight_shards, pull_weights, source_from_layout
from gyre.actors.errors import ActorError
from gyre.engines.grad_exchange import GradientExchangeError, ReductionBytes, ReductionMember, RendezvousServer
from gyre.engines.host_memory import keep_freed_tensor_memory
from gyre.engines.trainer import MegatronTrainer, TrainerConfig
from gyre.engines.trainer_group import ServedParams, TrainerGroup, build_trainer
from gyre.engines.transfer import host_sha256
from gyre.messages.gradient_rounds import FlushGradients, GradientsHeld, JoinReduction, RoundEnded
from gyre.messages.cell_internal import WeightSource
from gyre.messages.samples import TrainingSample
from gyre.messages.training import (
    ClaimGranted,
    ClaimMicroStep,
    MicroStepDone,
    ReleaseMicroStep,
    StepApplied,
    StepReady,
)
from gyre.policies.loss import (
    PackedBatch,
    combine_chunk_metrics,
    length_sorted_chunks,
    loss_from_samples,
    pack_samples,
)
from gyre.runtime import GyreError

__all__ = ["Ask", "ClaimLoop", "ClaimSettings", "CoreSteps", "GradientBufferError", "Offload", "RoundRecord", "Send",
           "StepProgress", "StepTracker", "TrainerHost"]

log = structlog.get_logger(__name__)

Offload = Callable[..., Awaitable[Any]]
"""Run a blocking call off the event loop: `await offload(fn, *args)` (the actor's `offload`)."""
Send = Callable[[str, Any], Awaitable[None]]
"""Send a message to an actor, waiting while its queue is full (the actor's `send`)."""
Ask = Callable[..., Awaitable[Any]]
"""Ask an actor and wait for the reply: `await ask(to, msg, timeout_s=...)` (the actor's `ask`)."""



class GradientBufferError(ActorError, ValueError):
    """A satellite's gradient buffer is not the size of this model's (another model, or a corrupt report)."""


class TrainerHost:
    """A MegatronTrainer plus the memory it shares through the cell's transfer agent and its side of the gradient
    reduction rounds.

    Registered with Mooncake: the live flat parameter buffer (the core serves pulls from it; a satellite pulls into
    it), or, for device weights the agent cannot register, a core's host copy of it (`ServedParams`), and, on the
    core, the fence. Gradients never go through Mooncake: a satellite's stay summed in its trainer
    until a round (engines/grad_exchange.py) reduces them into the core's `reduced` buffer; the core's rendezvous
    store is where each round's members meet. Every method blocks: the cell calls them off the event loop, the
    compute ones one at a time (under its compute lock), the round ones on the host's own reduction thread.
    """

    def __init__(self, trainer: MegatronTrainer | TrainerGroup, agent: Any, is_core: bool, fence_scratch: torch.Tensor,
                 address: str = "127.0.0.1", reduce_timeout_s: float = 60.0) -> None:
        self.trainer = trainer
        self.agent = agent
        self.is_core = is_core
        self.fence_scratch = fence_scratch
        self.params = trainer.param_buffer()
        self._registered: list[torch.Tensor] = []
        self._served = ServedParams(self.params, agent, ServedParams.choose(self.params, agent, serve=is_core),
                                    trainer.version)
        """How peers pull these weights (engines/trainer_group.py's ServedParams, the same for every rank of a
        trainer group): the live parameters, registered, or, where they lie in device memory the agent cannot
        register (a Mooncake build without CUDA), a host copy that takes every applied step and load under the
        fence. A satellite's own pulls into device parameters need no registration (they stage)."""
        self.fence = torch.full((1,), trainer.version, dtype=torch.int64)
        if is_core:
            self._register(self.fence)
        self.address = address
        self.rendezvous = RendezvousServer(address, reduce_timeout_s) if is_core else None
        self.member = (ReductionMember(trainer.device.type, reduce_timeout_s, store=self.rendezvous.store)
                       if self.rendezvous else None)
        """Core: its side of every round (a satellite's member lives with its claim loop, across trainers)."""
        self.sharded = isinstance(trainer, TrainerGroup)
        """A trainer of several processes: its rounds run lane by lane, each rank its own shard (reduce_lanes), and
        its weights move shard by shard (every rank registered with an agent of its own: `shards`)."""
        self.shards = trainer.shard_sources(agent, self._served) if isinstance(trainer, TrainerGroup) else []
        """Every rank's parameter shard as a pull source (peer, address, bytes), global rank order."""
        self.reduced = torch.zeros_like(self.params) if is_core and not self.sharded else None
        """Core of one process: the satellites' sum from the last round (added to the trainer only once the round
        checks out); a sharded core's ranks each keep their lane's sum."""

    @classmethod
    def build(
        cls, model_dir: str, config: TrainerConfig, agent: Any, is_core: bool, fence_scratch: torch.Tensor,
        address: str = "127.0.0.1", reduce_timeout_s: float = 60.0,
    ) -> TrainerHost:
        # Micro-steps allocate and free the same tensors over and over: let malloc keep them for reuse rather than
        # map and fault them in afresh each time (~13% of the trainer's CPU; engines/host_memory.py).
        if not keep_freed_tensor_memory():
            log.info("malloc_left_as_it_was", reason="no glibc mallopt here")
        return cls(build_trainer(model_dir, config), agent, is_core, fence_scratch, address, reduce_timeout_s)

    @property
    def served(self) -> torch.Tensor:
        """The buffer peers pull this trainer's weights (rank 0's shard) from: the live parameters or their host
        copy."""
        return self.params if self._served.buffer is None else self._served.buffer

    def _register(self, buffer: torch.Tensor) -> None:
        self.agent.register_tensor(buffer)
        self._registered.append(buffer)

    @property
    def version(self) -> int:
        return self.trainer.version

    @property
    def numel(self) -> int:
        return self.params.numel()

    @property
    def layout(self) -> tuple[int, int, int, int]:
        """The training layout (tensor, pipeline, data, expert): every cell of a round must share it."""
        sizes = self.trainer.sizes
        return (sizes.tensor, sizes.pipeline, sizes.data, sizes.expert)

    @property
    def lane_numels(self) -> tuple[int, ...]:
        """Elements of each rank's gradient buffer, global rank order: what lane g of a round reduces."""
        return self.trainer.lane_numels if isinstance(self.trainer, TrainerGroup) else (self.numel,)

    # ---- compute ------------------------------------------------------------------------------------------

    def compute(
        self, samples: Sequence[TrainingSample], num_executions: int, clip_low: float, clip_high: float,
        chunk_padded_tokens: int,
    ) -> dict[str, Any]:
        """Forward/backward of one micro-step, in length-sorted chunks (policies.loss.length_sorted_chunks) so that
        little compute goes into padding; gradients accumulate into the trainer. Returns the micro-step's metrics."""
        parts = []
        replicas = self.trainer.sizes.data
        for chunk in length_sorted_chunks(samples, chunk_padded_tokens):
            # A partial of a module-level function: a trainer group pickles it to its other ranks.
            def share(rows: Sequence[TrainingSample]) -> tuple | None:
                if not rows:
                    return None
                batch = pack_samples(rows)
                loss_fn = functools.partial(_sample_loss, batch=batch, num_executions=num_executions,
                                            clip_low=clip_low, clip_high=clip_high)
                return batch.input_ids, batch.lengths, loss_fn, batch.temperatures

            if replicas == 1:
                parts.append(self.trainer.forward_backward(*share(chunk)))
                continue
            # Data-parallel replicas: each its rows of the chunk (sorted by length, dealt round-robin, so the shares
            # pad alike); the loss is a sum over rows, so the replicas' gradients sum to the chunk's.
            results = self.trainer.forward_backward_shares([share(chunk[r::replicas]) for r in range(replicas)])
            parts.extend(result for result in results if result is not None)
        return combine_chunk_metrics(parts)

    # ---- gradients: reduction rounds ----------------------------------------------------------------------

    def reduce_as_core(self, round_id: int, group_id: int, size: int) -> tuple[ReductionBytes, list[bytes]]:
        """Core: run its side of a round (the satellites' sum into `reduced`) and read every member's held list.
        Raises GradientExchangeError."""
        assert self.member is not None and self.rendezvous is not None, "only the core leads a round"
        if isinstance(self.trainer, TrainerGroup):
            moved = sum_bytes(self.trainer.reduce_lanes(self.member, self.address, self.rendezvous.port, group_id,
                                                        0, size))
        else:
            assert self.reduced is not None
            moved = self.member.reduce(self.address, self.rendezvous.port, group_id, 0, size, self.reduced)
        return moved, [self.member.read_held(round_id, rank) for rank in range(1, size)]

    def add_reduced(self) -> None:
        """Core: the last round's sum into the step's gradients (under the compute lock)."""
        if isinstance(self.trainer, TrainerGroup):
            self.trainer.add_lane_sums()
            return
        assert self.reduced is not None
        self.trainer.add_flat_grads(self.reduced)

    def reduce_as_member(self, member: ReductionMember, join: JoinReduction, payload: bytes) -> ReductionBytes:
        """Satellite: leave the held list, reduce the trainer's gradients into the core (a sharded trainer: every
        rank its shard, over its lane), and zero them whatever the outcome (the core counts them or hands them
        back). Raises GradientExchangeError, GradientBufferError (another layout or model than the core's)."""
        try:
            check_layout(join, self.layout, self.lane_numels)
            if not isinstance(self.trainer, TrainerGroup):
                return join_round(member, join, payload, self.trainer.grad_buffer())
            member.publish_held(join.store_host, join.store_port, join.round_id, join.rank, payload)
            return sum_bytes(self.trainer.reduce_lanes(member, join.store_host, join.store_port, join.group_id,
                                                       join.rank, join.size))
        finally:
            self.trainer.zero_grads()

    def discard_grads(self) -> None:
        """Satellite: drop what its buffer holds (a micro-step failed halfway and polluted it)."""
        self.trainer.zero_grads()

    def apply_step(self) -> dict[str, Any]:
        """Core: the optimizer step, with the fence showing -1 while the parameters (and their host copy, if peers
        pull from one) change."""
        self.fence[0] = -1
        try:
            result = self.trainer.optimizer_step()  # a trainer group refreshes every rank's copy in the step
            self._refresh_served()
            return result
        finally:
            self.fence[0] = self.trainer.version

    def _refresh_served(self) -> None:
        if self._served.stale(self.trainer.version):
            self._served.refresh(self.trainer.version)

    def sync_served(self) -> None:
        """Core: bring a host copy of device parameters up to the live ones if they changed outside a step (a
        checkpoint restored into the one-process trainer), under the fence; nothing to do when peers pull the live
        buffer, or after a trainer group's loads (which refresh every rank's copy themselves)."""
        if not self._served.stale(self.trainer.version):
            return
        self.fence[0] = -1
        try:
            self._refresh_served()
        finally:
            self.fence[0] = self.trainer.version

    # ---- weights ------------------------------------------------------------------------------------------

    def source(self, cell: str) -> WeightSource:
        """Core: where peers pull these weights from."""
        self.sync_served()
        return source_from_layout(cell, self.version, self.agent.peer, self.served, self.fence,
                                  self.trainer.param_layout(), self.shards, self.layout)

    def pull(self, source: WeightSource) -> int:
        """Satellite: pull `source` straight into the live parameter buffer (a trainer of several processes: every
        rank its shard from the core's rank of the same place). The version reads -1 until the pull succeeds, so a
        failed or torn pull never passes for a real version. Raises StaleWeights, TransferError, WeightLayoutError."""
        self.trainer.version = -1
        if isinstance(self.trainer, TrainerGroup):
            moved = pull_weight_shards(self.agent, source, self.trainer, self.layout, self.lane_numels,
                                       self.fence_scratch)
        else:
            moved = pull_weights(self.agent, source, self.params, self.fence_scratch)
        self.trainer.version = source.version
        return moved

    def digest(self) -> str:
        """SHA-256 of the live parameters' bytes (copied to the host first where they lie on a device)."""
        return host_sha256(self.params)

    def close(self) -> None:
        """Unregister every buffer (peers' transfers into them fail from now on), leave the round group."""
        self._served.close()
        for buffer in self._registered:
            self.agent.unregister_tensor(buffer)
        self._registered.clear()
        if self.member is not None:
            self.member.drop()
        if isinstance(self.trainer, TrainerGroup):
            self.trainer.close()  # stops its worker processes


def _sample_loss(logprobs: torch.Tensor, *, batch: PackedBatch, num_executions: int, clip_low: float,
                 clip_high: float):
    return loss_from_samples(logprobs, batch, num_executions=num_executions, clip_low=clip_low, clip_high=clip_high)


def sum_bytes(lanes: Sequence[ReductionBytes]) -> ReductionBytes:
    """What a cell moved in a round: the sum over its lanes (ranks)."""
    return ReductionBytes(sum(lane.sent for lane in lanes), sum(lane.received for lane in lanes))


def _layout_name(layout: Sequence[int]) -> str:
    return "tp{}.pp{}.dp{}.ep{}".format(*layout)


def check_layout(join: JoinReduction, layout: tuple[int, int, int, int], lane_numels: Sequence[int]) -> None:
    """A member's trainer must have the core's training layout and, lane by lane, its buffer sizes: shard g of every
    cell reduces with shard g of the others. Raises GradientBufferError naming the difference."""
    if tuple(join.layout) != tuple(layout):
        raise GradientBufferError(
            f"round {join.round_id}: the core trains {_layout_name(join.layout)}, this cell {_layout_name(layout)}; "
            "the cells of a step share one training layout (every satellite's TrainerConfig tensor/pipeline/data/"
            "expert sizes must be the core's)")
    want = tuple(join.lane_numels) or (join.numel,)
    if tuple(lane_numels) != want:
        raise GradientBufferError(f"round {join.round_id} reduces lanes of {list(want)} elements; this trainer's "
                                  f"are {list(lane_numels)} (another model)")


def join_round(member: ReductionMember, join: JoinReduction, payload: bytes, grads: torch.Tensor) -> ReductionBytes:
    """A one-process member's side of a round: its held list into the store, then its gradients into the core."""
    if grads.numel() != join.numel:
        raise GradientBufferError(f"round {join.round_id} reduces {join.numel} elements; this buffer has "
                                  f"{grads.numel()} (another model)")
    member.publish_held(join.store_host, join.store_port, join.round_id, join.rank, payload)
    return member.reduce(join.store_host, join.store_port, join.group_id, join.rank, join.size, grads)


def join_round_with_zeros(member: ReductionMember, join: JoinReduction, payload: bytes) -> ReductionBytes:
    """A member without a trainer any more (it left training): zeros on every lane, one after the other from this
    process (the core's ranks wait on their lanes independently), so the round never waits for it."""
    numels = tuple(join.lane_numels) or (join.numel,)
    member.publish_held(join.store_host, join.store_port, join.round_id, join.rank, payload)
    return sum_bytes([member.reduce(join.store_host, join.store_port, join.group_id, join.rank, join.size,
                                    torch.zeros(numel, dtype=torch.float32, device=member.device), lane)
                      for lane, numel in enumerate(numels)])


def encode_held(entries: Sequence[GradientsHeld]) -> bytes:
    """A held list for the store: [[step, index, tokens, loss], ...] as JSON."""
    return json.dumps([[e.step_id, e.microstep_index, e.num_tokens, e.loss] for e in entries]).encode()


def decode_held(cell: str, payload: bytes) -> list[MicroStepDone]:
    """The micro-steps of a member's held list, as the MicroStepDone the claimer counts. Raises GradientBufferError
    for anything but a list of [int, int, int, number]."""
    try:
        rows = json.loads(payload)
    except ValueError as error:
        raise GradientBufferError(f"held list of {cell} is not JSON: {error}") from None
    if not isinstance(rows, list):
        raise GradientBufferError(f"held list of {cell} is not a list")
    out = []
    for row in rows:
        if not (isinstance(row, list) and len(row) == 4 and all(type(v) is int for v in row[:3])
                and isinstance(row[3], (int, float))):
            raise GradientBufferError(f"held list of {cell} has a bad entry {row!r}")
        out.append(MicroStepDone(cell, row[0], row[1], "", 0, 0, row[2], float(row[3])))
    return out


@attrs.frozen
class RoundRecord:
    """One reduction round as the core saw it."""

    round_id: int
    group_id: int
    members: tuple[str, ...]
    """The satellites (the core is rank 0)."""
    counted: bool
    microsteps: int
    received_bytes: int
    """What the core received: one gradient buffer, whatever the number of members."""
    join_s: float
    """Seconds the core spent forming the group (0 when it was reused)."""
    reason: str


@attrs.define
class StepProgress:
    """What the core knows of one optimizer step."""

    step_id: int
    ready: StepReady | None = None
    """The claimer's StepReady (the step's size), once it came."""
    done: dict[int, MicroStepDone] = attrs.field(factory=dict)
    """Micro-step index -> its report, for micro-steps whose gradients are in."""
    reserved: set[int] = attrs.field(factory=set)
    """Micro-steps the core is computing itself: their gradients land in its trainer as they are computed, so a
    satellite's copy of the same micro-step (the claimer re-queued it) must not be added too."""

    @property
    def complete(self) -> bool:
        return self.ready is not None and len(self.done) >= self.ready.num_microsteps


class StepTracker:
    """The core's count of micro-steps per step: which are in, and which step can be applied next (in order)."""

    def __init__(self, max_open_steps: int = 64) -> None:
        self.max_open_steps = max_open_steps
        self.open: dict[int, StepProgress] = {}
        self.applied_through = -1
        """Highest step id applied."""

    def _progress(self, step_id: int) -> StepProgress | None:
        if step_id <= self.applied_through:
            return None
        progress = self.open.get(step_id)
        if progress is None:
            if len(self.open) >= self.max_open_steps:
                raise ValueError(f"{len(self.open)} steps open at once (max {self.max_open_steps})")
            progress = self.open[step_id] = StepProgress(step_id)
        return progress

    def on_ready(self, msg: StepReady) -> bool:
        """Record a step's size. False for a step already applied."""
        progress = self._progress(msg.step_id)
        if progress is None:
            return False
        progress.ready = msg
        return True

    def _fits(self, progress: StepProgress | None, index: int) -> bool:
        if progress is None or index < 0 or index in progress.done:
            return False
        return progress.ready is None or index < progress.ready.num_microsteps

    def reserve(self, step_id: int, microstep_index: int) -> bool:
        """The core is about to compute this micro-step itself. False when its gradients are already in (or it is
        reserved, applied, outside the step): the core must then not compute it."""
        progress = self._progress(step_id)
        if not self._fits(progress, microstep_index) or microstep_index in progress.reserved:
            return False
        progress.reserved.add(microstep_index)
        return True

    def unreserve(self, step_id: int, microstep_index: int) -> None:
        progress = self.open.get(step_id)
        if progress is not None:
            progress.reserved.discard(microstep_index)

    def accept(self, msg: MicroStepDone, own: bool = False) -> bool:
        """Count a micro-step in (`own`: the core computed it). False (nothing recorded) for an applied step, a
        duplicate, an index outside the step, or another cell's copy of a micro-step the core computes itself."""
        progress = self._progress(msg.step_id)
        if not self._fits(progress, msg.microstep_index):
            return False
        if msg.microstep_index in progress.reserved:
            if not own:
                return False
            progress.reserved.discard(msg.microstep_index)
        progress.done[msg.microstep_index] = msg
        return True

    def forget(self, step_id: int, microstep_index: int) -> None:
        """Undo `accept` (the gradients never arrived)."""
        progress = self.open.get(step_id)
        if progress is not None:
            progress.done.pop(microstep_index, None)

    def next_complete(self) -> StepProgress | None:
        """The lowest open step, if all its micro-steps are in (steps apply in order)."""
        if not self.open:
            return None
        progress = self.open[min(self.open)]
        return progress if progress.complete else None

    def mark_applied(self, step_id: int) -> None:
        self.open.pop(step_id, None)
        self.applied_through = max(self.applied_through, step_id)


class CoreSteps:
    """The core's side of gradient exchange: count its own micro-steps, lead the reduction rounds that bring the
    satellites' in, apply complete steps in order.

    Explicit inputs, no cell: the core's trainer host, the names it talks to, the cell's compute lock, and how to
    offload blocking work and send a message. It sends what the exchange itself needs (JoinReduction and RoundEnded
    to a round's members, the counted MicroStepDone to the claimer) and returns what the cell acts on: whether a
    micro-step counted in or a round should run (`round_members`), and each applied step's StepApplied (the cell
    publishes it and decides what follows: the engine's weights, a checkpoint).
    """

    def __init__(
        self, host: TrainerHost, *, me: str, claimer: str, checkpoint_dir: str, compute_lock: asyncio.Lock,
        offload: Offload, send: Send, log: Any,
    ) -> None:
        self.host = host
        self.me = me
        """The core's own name: a MicroStepDone from it is the core's own compute (its gradients are in already)."""
        self.claimer = claimer
        self.checkpoint_dir = checkpoint_dir
        self.compute_lock = compute_lock
        self.offload = offload
        self.send = send
        self.log = log
        self.tracker = StepTracker()
        self.steps_applied = 0
        self.steps_skipped = 0
        self.marks: dict[str, dict[tuple[int, int], GradientsHeld]] = {}
        """Satellite -> the micro-steps it reported holding (for deciding when a round runs; what a round counts
        is the members' own held lists)."""
        self.last_round_of: dict[str, int] = {}
        self.last_ended: dict[str, RoundEnded] = {}
        self.flush_requests: set[str] = set()
        self.round_id = 0
        self.group_id = 0
        self._group_members: tuple[str, ...] = ()
        self._group_ok = False
        self.round_lock = asyncio.Lock()
        self.reduction_thread = concurrent.futures.ThreadPoolExecutor(1, "core-gradient-rounds")
        """A round blocks on its members for up to the group's timeout: a thread of its own never starves (or is
        starved by) compute, whatever else shares the process."""
        self.rounds = self.rounds_counted = self.rounds_failed = 0
        self.bytes_received = 0
        self.last_round_bytes = 0
        self.history: collections.deque[RoundRecord] = collections.deque(maxlen=64)
        """The last rounds (bounded: for logs and tests, not for bookkeeping)."""

    async def on_done(self, msg: MicroStepDone) -> bool:
        """Count one of the core's own micro-steps in (its gradients are in its trainer already) and tell the
        claimer. True when it counted (a step may be complete now); False for a duplicate or stale report, or a
        report from a satellite (satellites report GradientsHeld; their micro-steps count after a round)."""
        if msg.cell != self.me:
            self.log.error("microstep_done_from_a_satellite_ignored", from_cell=msg.cell, step_id=msg.step_id,
                           index=msg.microstep_index)
            return False
        if not self.tracker.accept(msg, own=True):
            self.log.warning("microstep_done_ignored", from_cell=msg.cell, step_id=msg.step_id,
                             index=msg.microstep_index, applied_through=self.tracker.applied_through)
            return False
        await self.send(self.claimer, msg)
        return True

    # ---- gradient reduction rounds ------------------------------------------------------------------------

    def on_held(self, msg: GradientsHeld) -> bool:
        """Note that a satellite holds a micro-step's gradients. False (nothing noted) for a report older than the
        satellite's last round (that round counted it or handed it back) or for a micro-step already in."""
        if msg.after_round < self.last_round_of.get(msg.cell, 0):
            self.log.info("gradients_held_report_void", from_cell=msg.cell, step_id=msg.step_id,
                          index=msg.microstep_index, after_round=msg.after_round)
            return False
        progress = self.tracker.open.get(msg.step_id)
        if msg.step_id <= self.tracker.applied_through or (progress and msg.microstep_index in progress.done):
            self.log.warning("gradients_held_for_what_is_in", from_cell=msg.cell, step_id=msg.step_id,
                             index=msg.microstep_index)
            return False
        self.marks.setdefault(msg.cell, {})[(msg.step_id, msg.microstep_index)] = msg
        return True

    def forget_cell(self, cell: str) -> None:
        """A satellite left training or restarted: what it reported holding is gone (the claimer re-queues it)."""
        if self.marks.pop(cell, None):
            self.log.info("held_gradients_forgotten", cell=cell)
        self.flush_requests.discard(cell)

    def round_members(self) -> tuple[str, ...]:
        """Who should join a round now (empty: no round). A round runs when a satellite asked to flush, or when the
        lowest open step has every micro-step in, in compute on the core, or held by a satellite."""
        holders = sorted(cell for cell, marks in self.marks.items() if marks)
        if self.flush_requests:
            return tuple(sorted(set(holders) | self.flush_requests))
        if not self.tracker.open:
            return ()
        progress = self.tracker.open[min(self.tracker.open)]
        if progress.ready is None:
            return ()
        held = {index for marks in self.marks.values() for (step, index) in marks if step == progress.step_id}
        if not held or len(held | set(progress.done) | progress.reserved) < progress.ready.num_microsteps:
            return ()
        return tuple(sorted(c for c in holders if any(step == progress.step_id for step, _ in self.marks[c])))

    def _check_lists(self, members: Sequence[str], lists: Sequence[Sequence[MicroStepDone]]) -> str:
        """Why a round's sum cannot be counted ("" when it can): a micro-step twice in it, or one already in or in
        compute on the core (a buffer cannot give one micro-step's gradients back, so the whole sum goes)."""
        seen: set[tuple[int, int]] = set()
        for cell, entries in zip(members, lists):
            for done in entries:
                key = (done.step_id, done.microstep_index)
                progress = self.tracker.open.get(done.step_id)
                if key in seen:
                    return f"micro-step {key} is in two members' buffers"
                if done.step_id <= self.tracker.applied_through or (
                        progress and (done.microstep_index in progress.done
                                      or done.microstep_index in progress.reserved)):
                    return f"micro-step {key} from {cell} is in already (or in compute on the core)"
                if progress is not None and progress.ready is not None and \
                        done.microstep_index >= progress.ready.num_microsteps:
                    return f"micro-step {key} from {cell} is outside its step"
                seen.add(key)
        return ""

    async def run_round(self, members: tuple[str, ...] | None = None) -> RoundEnded | None:
        """One reduction round with `members` (satellites; the core is rank 0; None: `round_members()` once the
        round's turn comes, and no round when that is empty): ask them to join, run the core's side, count the
        micro-steps of their held lists in (then the cell applies what is complete) or, when the round failed or its
        sum cannot be counted, count nothing (each member hands its micro-steps back). Every member hears
        RoundEnded. Rounds run one at a time."""
        host = self.host
        assert host.rendezvous is not None
        async with self.round_lock:
            if members is None:
                members = self.round_members()
                if not members:
                    return None
            self.flush_requests -= set(members)
            if members != self._group_members or not self._group_ok:
                self.group_id += 1
                self._group_members = members
            self.round_id += 1
            round_id, size = self.round_id, len(members) + 1
            for rank, cell in enumerate(members, 1):
                await self.send(cell, JoinReduction(round_id, self.group_id, rank, size, host.address,
                                                    host.rendezvous.port, host.numel, host.layout, host.lane_numels))
            loop = asyncio.get_running_loop()
            lists: list[list[MicroStepDone]] = []
            try:
                moved, payloads = await loop.run_in_executor(self.reduction_thread, host.reduce_as_core, round_id,
                                                             self.group_id, size)
                lists = [decode_held(cell, payload) for cell, payload in zip(members, payloads)]
                reason = self._check_lists(members, lists)
                self._group_ok = True
            except (GradientExchangeError, GradientBufferError) as error:
                reason, moved = str(error), None
                self._group_ok = False
            for cell in members:
                self.last_round_of[cell] = round_id
                self.marks[cell] = {k: m for k, m in self.marks.get(cell, {}).items() if m.after_round >= round_id}
            entries = [done for entries in lists for done in entries]
            if not reason:
                async with self.compute_lock:
                    await self.offload(host.add_reduced)
                for done in entries:
                    self.tracker.accept(done)
                    await self.send(self.claimer, done)
                self.rounds_counted += 1
            else:
                self.rounds_failed += 1
            if moved is not None:
                self.bytes_received += moved.received
                self.last_round_bytes = moved.received
            self.rounds += 1
            ended = RoundEnded(round_id, not reason, len(entries), reason)
            self.history.append(RoundRecord(round_id, self.group_id, members, not reason, len(entries),
                                            moved.received if moved else 0, host.member.last_join_s, reason))
            log = self.log.info if not reason else self.log.error
            log("gradient_round_ended", round=round_id, group=self.group_id, members=list(members),
                counted=not reason, microsteps=len(entries), reason=reason,
                received_bytes=moved.received if moved else 0, join_s=round(host.member.last_join_s, 4))
            for cell in members:
                self.last_ended[cell] = ended
                await self.send(cell, ended)
            return ended

    async def flush(self, msg: FlushGradients) -> RoundEnded:
        """A satellite leaves: the RoundEnded of a round that took its buffer after `msg.after_round` (the round under
        way may be it: it ends first), or of one run now for it and whoever else holds gradients."""
        while True:
            ended = self.last_ended.get(msg.cell)
            if ended is not None and ended.round_id > msg.after_round:
                return ended
            if self.round_lock.locked():
                async with self.round_lock:  # let the round under way end: it may be the one that takes it
                    pass
                continue
            self.flush_requests.add(msg.cell)
            if await self.run_round() is None:  # forgotten meanwhile (it restarted or left): nothing to take
                return RoundEnded(0, True, 0, "nothing held")

    def on_ready(self, msg: StepReady) -> bool:
        """Record a step's size. True when it is news (a step may be complete now); False for a step applied."""
        return self.tracker.on_ready(msg)

    async def apply_next(self) -> StepApplied | None:
        """Apply the lowest open step if all its micro-steps are in (steps apply in order) and return its
        StepApplied, for the cell to publish; None when no step is complete."""
        progress = self.tracker.next_complete()
        if progress is None:
            return None
        host = self.host
        async with self.compute_lock:
            result = await self.offload(host.apply_step)
        self.tracker.mark_applied(progress.step_id)
        self.steps_applied += 1
        skipped = bool(result.get("skipped"))
        reports = list(progress.done.values())
        ready = progress.ready
        assert ready is not None
        applied = StepApplied(
            step_id=progress.step_id,
            version=host.version,
            loss=sum(r.loss for r in reports) / max(1, len(reports)),
            grad_norm=float(result["grad_norm"]),
            num_tokens=sum(r.num_tokens for r in reports),
            num_samples=ready.num_samples,
            stale_samples_dropped=0,  # the claimer refuses stale samples; the core never sees them
            skipped=skipped,
        )
        if skipped:
            self.steps_skipped += 1
            self.log.warning("optimizer_step_skipped", step_id=progress.step_id, grad_norm=result["grad_norm"],
                             version=applied.version)
        self.log.info("step_applied", step_id=applied.step_id, version=applied.version, loss=applied.loss,
                      grad_norm=applied.grad_norm, microsteps=len(reports), skipped=skipped)
        return applied

    async def save_checkpoint(self, version: int) -> bool:
        """The weights of `version` to `<checkpoint_dir>/v<version>`; a failure (a full disk) is logged, not raised:
        a lost checkpoint must not stop the run. Returns whether it was saved."""
        path = Path(self.checkpoint_dir) / f"v{version:05d}"
        try:
            async with self.compute_lock:  # no step changes the weights while they are copied out
                await self.offload(self.host.trainer.save_hf, path)
        except OSError as error:
            self.log.error("checkpoint_failed", path=str(path), version=version, error=str(error))
            return False
        self.log.info("checkpoint_saved", path=str(path), version=version)
        return True


@attrs.frozen
class ClaimSettings:
    """What claiming needs to know of its cell (the cell builds it from its config)."""

    cell: str
    """The claiming cell's name."""
    is_core: bool
    """The core reports to itself and its gradients stay in its trainer; a satellite sends them to `core`."""
    claimer: str
    """Actor name of the micro-step claimer."""
    core: str
    """Actor name of the core cell."""
    claim_timeout_s: float
    """How long a ClaimMicroStep waits for the claimer."""
    claim_retry_s: float
    """Pause before claiming again after a failed claim."""
    grads_taken_timeout_s: float
    """How long a leaving satellite waits for the core to take its gradients in a round (FlushGradients)."""
    clip_low: float
    """GSPO lower clip range."""
    clip_high: float
    """GSPO upper clip range."""
    chunk_padded_tokens: int
    """Most padded tokens per compute chunk of a micro-step."""
    reduce_device: str = "cpu"
    """Where a satellite's trainer keeps its gradients ("cpu": gloo rounds, "cuda": NCCL)."""
    reduce_timeout_s: float = 60.0
    """Bound on every wait of a reduction round (forming its group, each transfer)."""

    @property
    def held_rounds_kept(self) -> int:
        """Rounds whose held lists a satellite keeps until their RoundEnded (one is ever open; a few cover late
        news): bounded so a core that never answers cannot grow them."""
        return 8


class ClaimLoop:
    """The body of the train role's loop: claim a micro-step, compute it, hand its gradients on (`claim_once`).
    The cell runs it over and over (a satellite first catches its trainer up) until it asks the loop to halt.

    Halting lets a micro-step whose compute started finish and report (it is one forward/backward); a grant that
    arrives after the halt was asked for is handed back with ReleaseMicroStep, untouched. A satellite keeps what it
    computed in its trainer until a round takes it (`join_round`); leaving, it asks for one (`flush`).

    Explicit inputs, no cell: its settings, how to ask, send and offload, the cell's compute lock; each claim gets
    the trainer host to compute with, and on the core the StepTracker to reserve its own micro-steps in.
    """

    def __init__(
        self, settings: ClaimSettings, *, ask: Ask, send: Send, offload: Offload, compute_lock: asyncio.Lock,
        log: Any,
    ) -> None:
        self.settings = settings
        self.ask = ask
        self.send = send
        self.offload = offload
        self.compute_lock = compute_lock
        self.log = log
        self._halt = asyncio.Event()
        self._wake = asyncio.Event()
        """Set by a ClaimsOpen: a pause for lack of work ends at once (microstep_claimer.py, Wake-ups)."""
        self.computed = 0
        self.released = 0
        self.held: list[GradientsHeld] = []
        """Satellite: the micro-steps summed in its trainer's gradients since its last round."""
        self.last_round = 0
        """Satellite: the last round it joined."""
        self._in_rounds: dict[int, list[GradientsHeld]] = {}
        """Satellite: what it brought to each round whose RoundEnded has not come yet (handed back if not counted)."""
        self._round_news = asyncio.Event()
        self._joining = 0
        """Satellite: rounds it is joining now (waiting for its compute lock or moving bytes)."""
        self.member = None if settings.is_core else ReductionMember(settings.reduce_device, settings.reduce_timeout_s)
        self.reduction_thread = concurrent.futures.ThreadPoolExecutor(1, f"{settings.cell}-gradient-rounds")
        self.rounds_joined = 0
        self.rounds_failed = 0
        """Rounds that failed on this side (the core then counts nothing either)."""
        self.rounds_not_counted = 0
        """Rounds whose RoundEnded said the core counted nothing."""
        self.bytes_sent = 0
        self.bytes_received = 0

    def resume(self) -> None:
        """Claim again (the cell entered the train role)."""
        self._halt.clear()

    def stop_claiming(self) -> None:
        """No new claim; a grant that comes after this goes back. The cell then waits for its loop to end."""
        self._halt.set()

    def wake(self) -> None:
        """The claimer says a claim would find work: end the pause now."""
        self._wake.set()

    @property
    def halting(self) -> bool:
        return self._halt.is_set()

    # ---- satellite: reduction rounds ----------------------------------------------------------------------

    async def join_round(self, msg: JoinReduction, host: TrainerHost | None) -> None:
        """Satellite: bring the held gradients to the core's round (a cell without a trainer any more brings zeros
        and an empty list, so the round never waits for it). The buffer is zeroed whatever the outcome; what it held
        waits for the round's RoundEnded (handed back unless counted)."""
        assert self.member is not None, "the core leads rounds, it does not join them"
        loop = asyncio.get_running_loop()
        self._joining += 1
        try:
            await self._join_round(msg, host, loop)
        finally:
            self._joining -= 1
            self._round_news.set()

    async def _join_round(self, msg: JoinReduction, host: TrainerHost | None, loop: asyncio.AbstractEventLoop) -> None:
        async with self.compute_lock:  # no micro-step adds to the buffer while it is reduced
            entries, self.held = self.held, []
            self.last_round = max(self.last_round, msg.round_id)
            self._in_rounds[msg.round_id] = entries
            while len(self._in_rounds) > self.settings.held_rounds_kept:
                self._in_rounds.pop(min(self._in_rounds))
            payload = encode_held(entries)
            try:
                if host is None:
                    moved = await loop.run_in_executor(self.reduction_thread, join_round_with_zeros, self.member,
                                                       msg, payload)
                else:
                    moved = await loop.run_in_executor(self.reduction_thread, host.reduce_as_member, self.member,
                                                       msg, payload)
            except (GradientExchangeError, GradientBufferError) as error:
                self.rounds_failed += 1
                self.log.error("gradient_round_failed_here", round=msg.round_id, held=len(entries), error=str(error))
            else:
                self.rounds_joined += 1
                self.bytes_sent += moved.sent
                self.bytes_received += moved.received
                self.log.info("gradient_round_joined", round=msg.round_id, rank=msg.rank, size=msg.size,
                              held=len(entries), sent_bytes=moved.sent, received_bytes=moved.received,
                              join_s=round(self.member.last_join_s, 4))

    async def on_round_ended(self, msg: RoundEnded) -> None:
        """Satellite: a round it joined ended; if the core did not count it, hand its micro-steps back."""
        entries = self._in_rounds.pop(msg.round_id, [])
        if not msg.counted:
            self.rounds_not_counted += 1
            self.log.error("gradient_round_not_counted_released", round=msg.round_id, microsteps=len(entries),
                           reason=msg.reason)
            for held in entries:
                self.released += 1
                await self.send(self.settings.claimer, ReleaseMicroStep(self.settings.cell, held.step_id,
                                                                        held.microstep_index))
        self._round_news.set()

    async def flush(self) -> bool:
        """Satellite leaving the train role (claims halted): have the core take what it holds in a round, and wait
        until every round it brought gradients to has ended (bounded). True when nothing is left in its hands."""
        settings = self.settings
        loop = asyncio.get_running_loop()
        deadline = loop.time() + settings.grads_taken_timeout_s
        if self.held:
            try:
                await self.ask(settings.core, FlushGradients(settings.cell, self.last_round),
                               timeout_s=settings.grads_taken_timeout_s)
            except GyreError as error:
                self.log.error("gradients_not_flushed", held=len(self.held), error=str(error))
                return False
        # A round's RoundEnded may come after the reply, and a round may be joining right now: wait for them (the
        # RoundEnded handler hands back what was not counted).
        while (self._in_rounds or self._joining) and loop.time() < deadline:
            self._round_news.clear()
            try:
                await asyncio.wait_for(self._round_news.wait(), max(0.001, deadline - loop.time()))
            except asyncio.TimeoutError:
                break
        return not self.held and not self._in_rounds and not self._joining

    def close(self) -> None:
        if self.member is not None:
            self.member.drop()
        self.reduction_thread.shutdown(wait=False)

    async def _pause(self, seconds: float) -> None:
        """Wait `seconds`, or less if the cell is asked to halt or the claimer wakes it."""
        if self._wake.is_set():  # a wake-up that came while the claim was on its way
            self._wake.clear()
            return
        waits = [asyncio.ensure_future(self._halt.wait()), asyncio.ensure_future(self._wake.wait())]
        try:
            await asyncio.wait(waits, timeout=max(seconds, 0.001), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        self._wake.clear()

    async def claim_once(self, host: TrainerHost, tracker: StepTracker | None) -> None:
        """One claim with `host`'s weight version: compute what is granted and report it, hand back what cannot be
        trained, or pause when there is nothing (or the claimer does not answer)."""
        settings = self.settings
        try:
            grant: ClaimGranted = await self.ask(
                settings.claimer, ClaimMicroStep(settings.cell, host.version), timeout_s=settings.claim_timeout_s
            )
        except GyreError as error:  # claimer slow, restarting or absent: try again later
            self.log.warning("claim_failed", error=str(error))
            await self._pause(settings.claim_retry_s)
            return
        if grant.step_id < 0:
            await self._pause(grant.retry_after_s if grant.retry_after_s > 0 else settings.claim_retry_s)
            return
        if self._halt.is_set() or not grant.samples:
            self.released += 1
            if not grant.samples:
                self.log.error("empty_microstep_released", step_id=grant.step_id, index=grant.microstep_index)
            await self.send(settings.claimer, ReleaseMicroStep(settings.cell, grant.step_id, grant.microstep_index))
            return
        await self._compute_and_report(grant, host, tracker)

    async def _compute_and_report(self, grant: ClaimGranted, host: TrainerHost, tracker: StepTracker | None) -> None:
        settings = self.settings
        if tracker is not None and not tracker.reserve(grant.step_id, grant.microstep_index):
            # A satellite's gradients for it reached the core already (the claimer re-queued it in between).
            self.log.info("microstep_already_in", step_id=grant.step_id, index=grant.microstep_index)
            return
        failure: ValueError | None = None
        discarded: list[GradientsHeld] = []
        async with self.compute_lock:
            try:
                metrics = await self.offload(host.compute, grant.samples, grant.num_executions_in_step,
                                             settings.clip_low, settings.clip_high, settings.chunk_padded_tokens)
            except ValueError as error:  # bad samples (LossInputError, TrainerError): hand it back, say loudly why
                failure = error
                if not settings.is_core:
                    # Its buffer may hold part of the failed micro-step: what it held goes back with it.
                    await self.offload(host.discard_grads)
                    discarded, self.held = self.held, []
            else:
                if not settings.is_core:
                    # Noted under the lock: a round's snapshot of `held` is exactly what the buffer sums.
                    held = GradientsHeld(settings.cell, grant.step_id, grant.microstep_index,
                                         int(metrics["num_tokens"]), float(metrics["loss"]), self.last_round)
                    self.held.append(held)
        if failure is not None:
            if tracker is not None:
                tracker.unreserve(grant.step_id, grant.microstep_index)
            self.released += 1 + len(discarded)
            self.log.error("microstep_failed_released", step_id=grant.step_id, index=grant.microstep_index,
                           error=str(failure), held_released=len(discarded))
            await self.send(settings.claimer, ReleaseMicroStep(settings.cell, grant.step_id, grant.microstep_index))
            for entry in discarded:
                await self.send(settings.claimer, ReleaseMicroStep(settings.cell, entry.step_id,
                                                                   entry.microstep_index))
            return
        self.computed += 1
        tokens, loss = int(metrics["num_tokens"]), float(metrics["loss"])
        # How far the trained policy is from the behaviour policy, per micro-step: a clip fraction near 1 says
        # the clip range is too tight for this staleness and learning rate (GSPO clips the sequence ratio).
        self.log.info("microstep_computed", step_id=grant.step_id, index=grant.microstep_index, tokens=tokens,
                      loss=loss, clip_fraction=round(float(metrics.get("clip_fraction", 0.0)), 4),
                      seq_log_ratio_abs_max=float(metrics.get("seq_log_ratio_abs_max", 0.0)))
        if settings.is_core:
            await self.send(settings.cell, MicroStepDone(settings.cell, grant.step_id, grant.microstep_index, "", 0, 0,
                                                         tokens, loss))
            return
        await self.send(settings.core, held)
