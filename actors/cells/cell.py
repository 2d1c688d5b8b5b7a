"""The cell actor: one slice of hardware that serves rollouts or trains, and switches between the two.

Engine kinds (`CellConfig.engine_kind`): "embedded" runs the engine in the cell's process and serves it over HTTP
(actors/cells/rollout_role.py); "server" launches an engine server as a child process (Gyre's or SGLang's, see
actors/cells/engine_process.py) and "url" uses one someone else runs; both of these drive it only over SGLang's
HTTP API (actors/cells/server_host.py). A switch is ordered the same way for all three. A server that does not
start, dies or breaks is published as EngineServerFailed (with its last output lines) and fails the cell.

Roles. In the rollout role the cell serves its engine over HTTP and reports load
every `report_interval_s`. In the train role it runs the claim loop (actors/cells/train_role.py). While it switches
its role reads "switching". The core cell is a cell like the others with one difference: it always holds the
trainer with the authoritative weights and optimizer state, registered with Mooncake for peers to pull, and it
reduces every micro-step's gradients and applies the optimizer steps *whatever its role*. So the core can also
serve rollouts in its spare time: in the rollout role it keeps its trainer, keeps applying steps that satellites'
gradients complete, and loads each new version into its own engine straight from its trainer. Which role it plays
is the scheduler's call, as for any cell. Satellites hold a trainer only in the train role; leaving it releases
the trainer (they never step, so they never hold optimizer state).

A switch runs as a background task (the mailbox stays free: a satellite must still join a gradient round and hear
its RoundEnded while it winds down) and ends by telling the cell `SwitchFinished`, whose handler commits the role
and announces it.

Who holds what. The cell owns all of its state (its role, the newest version it has heard of, the engine and trainer
hosts, its counters) and orders every step: the switches, the claim loop (ClaimLoop.claim_once, over and over),
the engine following new weights (EngineWeights.newest, then load), what follows an applied step. Its helpers
(RolloutHost, EngineWeights in actors/cells/rollout_role.py; TrainerHost, CoreSteps, ClaimLoop in
actors/cells/train_role.py; WeightPuller in actors/cells/weight_pull.py) never see the cell: they take explicit
inputs and return results.

Statistics: `StatisticsAsked` gets `CellStatistics` (counters only, cheap); `WeightsDigestAsked` gets the hash of
the weights the cell holds (`WeightsDigest`), apart because it costs a pass over the weights.

rollout -> train: refused (logged, the cell stays) when no other rollout cell is known to take the sessions, unless
the switch says `migrate_sessions=False` (the colocate baseline: every cell leaves rollout at once; the sessions
stay unplaced, their generations are aborted, and the proxy holds their calls until a cell rolls out again).
Otherwise: CellDraining (the proxy stops routing here) -> pause generation in place -> ask the KV migrator to move
every live session to the other rollout cells (it asks the proxy which sessions live here; the cell names the
sequences paused in place so that their partial output moves too) -> abort what is still in flight (the proxy
resubmits prompt + partial output where the session went, which finds it cached) -> stop the server, release the
engine's memory -> the newest weights into a trainer (a satellite builds it while the migration runs, then pulls)
-> RoleChanged(train) -> claim.

train -> rollout: stop claiming (a micro-step in compute finishes and reports, a later grant goes back) -> a
satellite has the core take its last gradients in a round (FlushGradients, actors/cells/train_role.py) and releases
its trainer -> the engine gets its memory back
(concurrently) and the newest weights -> serve -> RoleChanged(rollout).
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import attrs
import torch

from gyre.actors.cells.core_checkpoint import CoreCheckpoints, resumed_engine_weights
from gyre.actors.cells.engine_process import EMBEDDED, ENGINE_KINDS, URL, EngineServerConfig
from gyre.actors.cells.engine_process import EngineServerFailed as ServerFailure
from gyre.actors.cells.rollout_role import EngineWeights, PeerView, RecentSessions, RolloutHost
from gyre.actors.cells.server_host import ServerRolloutHost
from gyre.actors.cells.train_role import ClaimLoop, ClaimSettings, CoreSteps, TrainerHost
from gyre.actors.cells.weight_pull import WeightLayoutError, WeightPuller, WeightsUnavailable
from gyre.engines.embedded_engine import EngineConfig
from gyre.engines.model_format import ModelSpec
from gyre.engines.trainer import TrainerConfig, prepare_training_runtime
from gyre.engines.transfer import TransferAgent, TransferConfig
from gyre.messages.cell_internal import (
    CellStatistics,
    ReportTick,
    SwitchFinished,
    WeightsDigest,
    WeightsDigestAsked,
    WeightSource,
    WeightsQuery,
)
from gyre.messages.cells import (
    ROLLOUT,
    SWITCHING,
    TRAIN,
    CellDraining,
    EngineServerFailed,
    LoadReport,
    MigrateSessions,
    RoleChanged,
    SessionPlaced,
    SessionsMigrated,
    SwitchRole,
)
from gyre.messages.executions import ExecutionEnded
from gyre.messages.model_calls import ModelCallCompleted
from gyre.messages.gradient_rounds import FlushGradients, GradientsHeld, JoinReduction, RoundEnded, RoundFinished
from gyre.messages.training import ClaimsOpen, MicroStepDone, StepApplied, StepReady, WeightsLoaded, WeightsPublished
from gyre.runtime import Actor, GyreError, handler
from gyre.runtime.errors import ConfigError
from gyre.runtime.launch import node_address
from gyre.runtime.validators import positive

__all__ = ["Cell", "CellConfig"]

ROLES = (ROLLOUT, TRAIN)


@attrs.frozen
class CellConfig:
    """One cell. The cell's name is its actor name."""

    model_dir: str
    """HF model directory both the engine and the trainer start from (weight version 0)."""
    is_core: bool = False
    """The core holds the authoritative weights and optimizer state and applies the steps."""
    initial_role: str = attrs.field(default=ROLLOUT, validator=attrs.validators.in_(ROLES))
    """Role at start: "rollout" or "train"."""
    engine: EngineConfig = EngineConfig()
    """The engine's sizes and limits (embedded, or Gyre's engine server as flags)."""
    engine_kind: str = attrs.field(default=EMBEDDED, validator=attrs.validators.in_(ENGINE_KINDS))
    """"embedded" (the engine in this process), "server" (a child process this cell launches and stops) or "url"
    (a server someone else runs, at engine_server.url)."""
    engine_server: EngineServerConfig = EngineServerConfig()
    """Kinds "server" and "url": the command line (preset, extra arguments) or URL, start and stop limits."""
    trainer: TrainerConfig = TrainerConfig()
    """The trainer's optimizer settings and training layout (tensor/pipeline/data/expert sizes: above 1, a
    TrainerGroup of several processes). The cells of a step share one layout: a satellite's must be the core's (its
    rounds and weight pulls go shard by shard, and refuse another layout)."""
    claimer: str = "claimer"
    """Actor name of the micro-step claimer."""
    migrator: str = "kv_migrator"
    """Actor name of the KV migrator."""
    broker: str = "weight_broker"
    """Actor name of the weight broker."""
    core: str = "core"
    """Actor name of the core cell (where satellites send gradients)."""
    report_interval_s: float = attrs.field(default=1.0, validator=positive)
    """Time between LoadReports."""
    host: str = attrs.field(factory=node_address)
    """Address the engine server binds and that peers (and Mooncake) reach this cell at. Default: this node's address
    (gyre.runtime.launch.node_address, read where the config is made: each Ray host makes its topology on its node,
    so it is the node's address there; 127.0.0.1 on one machine)."""
    port: int = 0
    """Engine server port; 0 picks a free one (then reused across switches when it is still free)."""
    transfer_protocol: str = attrs.field(default="tcp", validator=attrs.validators.in_(("tcp", "rdma")))
    """Mooncake transport of the cell's own transfers (weight pulls, gradients, an embedded engine's KV): "tcp" on
    any node, "rdma" where the node has an RDMA NIC (the cell fails at start, saying so, on a node without one). An
    engine server child (engine_kind "server") moves its KV over TCP whatever this says: its command line takes no
    protocol yet."""
    rdma_devices: str = ""
    """With "rdma": the devices to use, comma-separated ("mlx5_0,mlx5_1"); "" = every one the node has."""
    clip_low: float = 3e-4
    """GSPO lower clip range."""
    clip_high: float = 4e-4
    """GSPO upper clip range."""
    prepare_trainer_at_start: bool = False
    """Satellite: import and set up the training runtime (engines.trainer.prepare_training_runtime) in the background
    as the cell starts, so its first switch into training does not pay 5-13 s in the middle of a run. Worth it when
    satellites are expected to train (the elastic policy); it costs the import's memory and CPU on every cell."""
    train_chunk_padded_tokens: int = attrs.field(default=2048, validator=positive)
    """A micro-step is computed in length-sorted chunks of at most this many tokens once padded (a longer sample
    gets a chunk of its own): less padding, and a bound on activation memory."""
    claim_timeout_s: float = attrs.field(default=30.0, validator=positive)
    """How long a ClaimMicroStep waits for the claimer."""
    claim_retry_s: float = attrs.field(default=0.2, validator=positive)
    """Pause before claiming again after a failed claim (a "no work" answer brings its own hint)."""
    migrate_timeout_s: float = attrs.field(default=120.0, validator=positive)
    """How long the KV migration of a draining cell may take before the cell aborts and lets the proxy re-prefill."""
    grads_taken_timeout_s: float = attrs.field(default=60.0, validator=positive)
    """How long a satellite leaving training waits for the core to take its gradients in a round."""
    reduce_timeout_s: float = attrs.field(default=60.0, validator=positive)
    """Bound on every wait of a gradient reduction round (forming its group, each transfer): a member that is dead
    or this slow fails the round, and its micro-steps are trained again."""
    server_shutdown_s: float = attrs.field(default=10.0, validator=positive)
    """Grace time for the engine server's open requests when it stops (they are aborted anyway)."""
    broker_timeout_s: float = attrs.field(default=10.0, validator=positive)
    """How long a WeightsQuery waits for the broker."""
    pull_attempts: int = attrs.field(default=50, validator=positive)
    """Attempts at a weight pull (a torn read, a step in progress, the broker busy) before the cell fails."""
    pull_retry_s: float = attrs.field(default=0.02, validator=positive)
    """Pause between pull attempts."""
    session_ttl_s: float = attrs.field(default=600.0, validator=positive)
    """A session counts as live on this cell (LoadReport.live_sessions) until this long after its last call here
    (agents run tools between calls), or until the executor publishes its ExecutionEnded. The proxy knows sessions
    exactly; this is the cell's estimate."""
    max_sessions: int = attrs.field(default=65536, validator=positive)
    """Sessions the estimate remembers at most."""
    save_dir: str = ""
    """Core only: when the cell stops, save its authoritative weights here as an HF model directory ("" = don't)."""
    average_save_dir: str = ""
    """Core only, with `trainer.average_decay` > 0: when the cell stops, also save the weights' moving average here
    ("" = don't)."""
    checkpoint_dir: str = ""
    """Core only: after every `checkpoint_every_steps`-th applied step, save the weights as an HF model directory
    `<checkpoint_dir>/v<version>` ("" = never). A failed save is logged and training goes on."""
    checkpoint_every_steps: int = attrs.field(default=1, validator=positive)
    """Steps between checkpoints (versions divisible by it are saved)."""
    run_checkpoint_dir: str = ""
    """Core only: the root of the run's full checkpoints ("" = none): after every `run_checkpoint_every_steps`-th
    step the core writes its trainer state there and tells `checkpointer` (actors/cells/core_checkpoint.py)."""
    run_checkpoint_every_steps: int = attrs.field(default=1, validator=positive)
    """Steps between full checkpoints (step ids s with (s + 1) divisible by it)."""
    checkpointer: str = "checkpointer"
    """Actor name of the checkpointer (actors/training/checkpointer.py)."""
    resume_from: str = ""
    """A committed checkpoint folder ("" = start afresh): the core restores its trainer from it; a satellite starts
    its engine only on the checkpoint's weights (core_checkpoint.resumed_engine_weights)."""

    def __attrs_post_init__(self) -> None:
        if self.rdma_devices and self.transfer_protocol != "rdma":
            raise ConfigError(f"rdma_devices {self.rdma_devices!r} needs transfer_protocol 'rdma'")
        if self.engine_kind == URL and not self.engine_server.url:
            raise ConfigError("engine_kind 'url' needs engine_server.url (the server's base URL)")
        if self.average_save_dir and self.trainer.average_decay <= 0:
            raise ConfigError("average_save_dir needs a trainer that keeps a weight average (trainer.average_decay > 0)")


class Cell(Actor):
    """See the module docstring."""

    config_cls = CellConfig
    subscriptions = (RoleChanged, LoadReport, CellDraining, SessionPlaced, WeightsPublished, StepReady,
                     ExecutionEnded, ModelCallCompleted)

    async def on_start(self) -> None:
        config = self.config
        self.role = SWITCHING
        self.engine_url = ""
        self.peers = PeerView(self.name)
        self.spec = ModelSpec.from_model_dir(config.model_dir)
        self.compute_lock = asyncio.Lock()
        self.agent: Any = None
        self.fence_scratch = torch.zeros(1, dtype=torch.int64)
        self.rollout: RolloutHost | ServerRolloutHost | None = None
        self.training: TrainerHost | None = None
        self.engine_weights: EngineWeights | None = None
        """Made with the engine host, at the start."""
        self.core_steps: CoreSteps | None = None
        self.last_applied: StepApplied | None = None  # the core's newest, told again to a claimer that missed it
        """The core's step bookkeeping, made with its trainer at the start (core_ready is set then)."""
        self.core_ready = asyncio.Event()
        self.run_checkpoints: CoreCheckpoints | None = None
        """The core's part of the run's full checkpoints, made with its trainer."""
        self.claims = ClaimLoop(
            ClaimSettings(cell=self.name, is_core=config.is_core, claimer=config.claimer, core=config.core,
                          claim_timeout_s=config.claim_timeout_s, claim_retry_s=config.claim_retry_s,
                          grads_taken_timeout_s=config.grads_taken_timeout_s, clip_low=config.clip_low,
                          clip_high=config.clip_high, chunk_padded_tokens=config.train_chunk_padded_tokens,
                          reduce_device=config.trainer.device or ("cuda" if torch.cuda.is_available() else "cpu"),
                          reduce_timeout_s=config.reduce_timeout_s),
            ask=self.ask, send=self.send, offload=self.offload, compute_lock=self.compute_lock, log=self.log,
        )
        self._claim_task: asyncio.Task | None = None
        self._round_task: asyncio.Task | None = None
        self._weights_task: asyncio.Task | None = None
        self.latest_version = 0
        """Newest weight version this cell has heard of (WeightsPublished, StepReady, its own pulls)."""
        self.pending_switch: SwitchRole | None = None
        self.switches = 0
        self.switches_refused = 0
        self.engine_weight_updates = 0
        self.engine_weight_updates_refused = 0
        self.last_weight_update_s = 0.0
        self.last_weight_update_path = ""
        self.puller = WeightPuller(self._ask_weight_source, self.name, config.pull_attempts, config.pull_retry_s,
                                   self.log)
        self.sessions = RecentSessions(config.session_ttl_s, config.max_sessions, self.clock.now)
        self.spawn(self.guarded(self._start_role(config.initial_role)), name=f"{self.name}.start")
        if config.prepare_trainer_at_start and not config.is_core:
            self.spawn(self._prepare_training_runtime(), name=f"{self.name}.prepare_training")
        self.send_later(config.report_interval_s, ReportTick())

    async def _prepare_training_runtime(self) -> None:
        started = self.clock.now()
        try:
            await self.offload(prepare_training_runtime)
        except Exception:  # the first switch into training builds it again and fails there, with the cell's handling
            self.log.exception("training_runtime_not_prepared")
            return
        self.log.info("training_runtime_prepared", seconds=round(self.clock.now() - started, 3))

    async def on_stop(self) -> None:
        config = self.config
        if config.is_core and self.training is not None:
            if self.run_checkpoints is not None:
                await self.run_checkpoints.on_stop(self.training)
            trainer = self.training.trainer
            if config.save_dir:
                await self.offload(trainer.save_hf, config.save_dir)
                self.log.info("final_weights_saved", path=config.save_dir, version=trainer.version)
            if config.average_save_dir:
                await self.offload(trainer.save_hf, config.average_save_dir, True)
                self.log.info("final_average_saved", path=config.average_save_dir, version=trainer.version,
                              decay=trainer.config.average_decay)
        await self._release_all()

    # ---- resources ----------------------------------------------------------------------------------------

    async def _release_all(self) -> None:
        self.claims.close()
        if self.rollout is not None:
            await self.rollout.close()
            self.rollout = None
        if self.training is not None:
            self.training.close()
            self.training = None
        if self.agent is not None:
            self.agent.close()
            self.agent = None

    def _engine_server_failed(self, error: ServerFailure) -> None:
        """Tell everyone (the proxy stops routing here; an operator reads why) before the failure fails the cell."""
        url = self.rollout.base_url if isinstance(self.rollout, ServerRolloutHost) else ""
        code = -1 if error.exit_code is None else error.exit_code
        self.publish(EngineServerFailed(self.name, url, str(error), code, error.last_output))

    async def guarded(self, work: Any) -> None:
        """Run a role's background work (a switch, the claim loop); if it fails, free the server, engine and
        buffers before the actor fails (its restart builds everything anew, and nothing of this incarnation may
        stay listening or registered)."""
        try:
            await work
        except asyncio.CancelledError:
            raise
        except BaseException:
            self.log.exception("role_task_failed")
            await self._release_all()
            raise

    async def _build_trainer(self) -> None:
        config = self.config
        self.training = await self.offload(TrainerHost.build, config.model_dir, config.trainer, self.agent,
                                           config.is_core, self.fence_scratch, config.host, config.reduce_timeout_s)

    # ---- weights ------------------------------------------------------------------------------------------

    async def _ask_weight_source(self) -> WeightSource:
        return await self.ask(self.config.broker, WeightsQuery(self.name), timeout_s=self.config.broker_timeout_s)

    def _heard_of(self, version: int) -> None:
        self.latest_version = max(self.latest_version, version)

    def tell_broker(self, msg: Any) -> None:
        try:
            self.tell(self.config.broker, msg)
        except GyreError as error:
            self.log.warning("broker_not_told", type=type(msg).__name__, error=str(error))

    async def catch_up_trainer(self, always_ask: bool = False) -> None:
        """Satellite in the train role: pull the newest weights straight into the trainer if they are newer than
        its own (asking the broker only when a newer version was announced, unless `always_ask`)."""
        host = self.training
        assert host is not None
        if not always_ask and self.latest_version <= host.version:
            return
        started = self.clock.now()

        async def pull_into_trainer(source: WeightSource) -> None:
            async with self.compute_lock:
                await self.offload(host.pull, source)

        source = await self.puller.pull(lambda: host.version, pull_into_trainer)
        if source is not None:
            self._heard_of(source.version)
            self.tell_broker(WeightsLoaded(self.name, source.version, self.clock.now() - started))

    async def _newest_engine_weights(self) -> tuple[dict[str, torch.Tensor] | None, int]:
        """EngineWeights.newest, noting a version pulled as heard of. Raises WeightsUnavailable."""
        assert self.engine_weights is not None
        weights, version = await self.engine_weights.newest()
        if weights is not None:
            self._heard_of(version)
        return weights, version

    def _follow_engine_weights(self) -> None:
        """In the rollout role: start loading newer weights into the engine unless that is already under way."""
        if self.role != ROLLOUT or (self._weights_task is not None and not self._weights_task.done()):
            return
        # Guarded: an engine server that breaks under an update fails the cell with its resources freed.
        self._weights_task = self.spawn(self.guarded(self._load_newer_weights()), name=f"{self.name}.weights")

    async def _settle_engine_weights(self) -> None:
        """Wait for a load under way to end (a switch must not stop the engine under it)."""
        if self._weights_task is not None and not self._weights_task.done():
            await asyncio.shield(self._weights_task)

    async def _load_newer_weights(self) -> None:
        """Rollout role: pause in place, load, continue, until the engine holds the newest version heard of; in-flight
        requests keep their tokens' versions. Stops as soon as the cell leaves the rollout role."""
        while self.role == ROLLOUT and self.rollout is not None and self.rollout.serving:
            current = self.rollout.weight_version
            newest = self.training.version if self.config.is_core and self.training else self.latest_version
            if newest <= current:
                return
            started = self.clock.now()
            try:
                weights, version = await self._newest_engine_weights()
            except WeightsUnavailable as error:  # keep serving the weights it has; the next publication retries
                self.log.error("engine_weights_not_updated", version=current, newest=newest, error=str(error))
                return
            except WeightLayoutError as error:  # e.g. a tensor-parallel core's shards: this engine cannot take them
                self.engine_weight_updates_refused += 1
                self.log.error("engine_weights_not_updated", version=current, newest=newest, error=str(error))
                return
            if weights is None or version <= current or self.role != ROLLOUT:
                return
            await self.rollout.load_weights(weights, version)
            seconds = self.clock.now() - started
            self.engine_weight_updates += 1
            self.last_weight_update_s = seconds
            self.last_weight_update_path = self.rollout.last_weight_update_path  # memory, disk or distributed
            self.log.info("engine_weights_loaded", version=version, seconds=round(seconds, 4),
                          path=self.last_weight_update_path)
            self.tell_broker(WeightsLoaded(self.name, version, seconds))

    # ---- training -----------------------------------------------------------------------------------------

    def _start_claiming(self) -> None:
        assert self._claim_task is None or self._claim_task.done(), "the claim loop is running"
        self.claims.resume()
        self._claim_task = self.spawn(self.guarded(self._claim_loop()), name=f"{self.name}.claims")

    async def _claim_loop(self) -> None:
        """The train role: a satellite catches its trainer up, then one claim is made, computed and reported; until
        the claims are halted."""
        while not self.claims.halting:
            if not self.config.is_core:
                await self.catch_up_trainer()
            assert self.training is not None
            await self.claims.claim_once(self.training, self.core_steps.tracker if self.core_steps else None)

    async def _halt_claims(self) -> None:
        """Stop claiming and wait for the loop to end (a micro-step in compute finishes and reports first)."""
        self.claims.stop_claiming()
        if self._claim_task is not None:
            await asyncio.shield(self._claim_task)

    async def _apply_ready_steps(self) -> None:
        """Core: apply every complete step in order; publish each, then let the engine follow and checkpoint."""
        config = self.config
        steps = self.core_steps
        assert steps is not None
        while (applied := await steps.apply_next()) is not None:
            self.last_applied = applied
            self.publish(applied)
            assert self.run_checkpoints is not None and self.training is not None
            if not applied.skipped:
                self._follow_engine_weights()
                # Before the full checkpoint: the last step's StepApplied may end the run, and the weights of that
                # version are the cheap part to save (the full checkpoint of a step cut off here is taken at stop).
                if config.checkpoint_dir and applied.version % config.checkpoint_every_steps == 0:
                    await steps.save_checkpoint(applied.version)
            await self.run_checkpoints.after_step(self.training, applied)

    # ---- roles --------------------------------------------------------------------------------------------

    async def _start_role(self, role: str) -> None:
        """The initial role (a switch from nothing)."""
        config = self.config
        started = self.clock.now()
        self.agent = await self.offload(TransferAgent, TransferConfig(
            hostname=config.host, protocol=config.transfer_protocol, device_name=config.rdma_devices))
        self.agent.register_tensor(self.fence_scratch)
        if config.engine_kind == EMBEDDED:
            self.rollout = RolloutHost(config.model_dir, config.engine, self.agent, config.host, config.port,
                                       config.server_shutdown_s, self.offload, self.sessions)
        else:
            self.rollout = ServerRolloutHost(
                config.engine_kind, config.model_dir, self.spec, config.engine, config.engine_server, self.agent,
                config.host, config.port, self.offload, self.sessions,
                spawn=lambda work, name: self.spawn(self.guarded(work), name=f"{self.name}.{name}"),
                report=self._engine_server_failed, clock=self.clock.now,
                transfer_protocol=config.transfer_protocol, rdma_devices=config.rdma_devices,
            )
        if config.is_core:
            await self._build_trainer()
            assert self.training is not None
            self.core_steps = CoreSteps(self.training, me=self.name, claimer=config.claimer,
                                        checkpoint_dir=config.checkpoint_dir, compute_lock=self.compute_lock,
                                        offload=self.offload, send=self.send, log=self.log)
            self.run_checkpoints = CoreCheckpoints(
                root=config.run_checkpoint_dir, every_steps=config.run_checkpoint_every_steps,
                resume_from=config.resume_from, me=self.name, checkpointer=config.checkpointer,
                compute_lock=self.compute_lock, offload=self.offload, tell=self.tell, log=self.log)
            await self.run_checkpoints.restore(self.training, self.core_steps.tracker)
            self.tell_broker(self.training.source(self.name))
            self.core_ready.set()
        self.engine_weights = EngineWeights(
            self.rollout, spec=self.spec, puller=self.puller, agent=self.agent, fence_scratch=self.fence_scratch,
            compute_lock=self.compute_lock, offload=self.offload, trainer=self.training if config.is_core else None,
        )
        url = ""
        if role == TRAIN:
            if self.training is None:
                await self._build_trainer()
            if not config.is_core:
                await self.catch_up_trainer(always_ask=True)
            version = self.training.version
        else:
            weights, version = await self._newest_engine_weights()
            if config.resume_from and not config.is_core:
                weights, version = await resumed_engine_weights(self._newest_engine_weights, (weights, version),
                                                                config.resume_from, retry_s=config.claim_retry_s,
                                                                clock=self.clock.now)
            url = await self.rollout.start(weights, version)
            version = self.rollout.weight_version
            self.tell_broker(WeightsLoaded(self.name, version, self.clock.now() - started))
        self.tell(self.name, SwitchFinished(role, "", url, version, self.clock.now() - started, 0))

    def _begin_switch(self, msg: SwitchRole) -> None:
        if msg.role == TRAIN:
            targets = self.peers.rollout_targets() if msg.migrate_sessions else {}
            if msg.migrate_sessions and not targets:
                self.switches_refused += 1
                self.log.warning("switch_refused", role=msg.role, reason=msg.reason,
                                 why="no other rollout cell is known to take this cell's sessions")
                return
            self.role = SWITCHING
            self.spawn(self.guarded(self._rollout_to_train(targets)), name=f"{self.name}.to_train")
        else:
            self.role = SWITCHING
            self.spawn(self.guarded(self._train_to_rollout()), name=f"{self.name}.to_rollout")
        self.log.info("switch_started", role=msg.role, reason=msg.reason, migrate_sessions=msg.migrate_sessions)

    async def _rollout_to_train(self, targets: dict[str, str]) -> None:
        """`targets` empty: the sessions stay where they are (nowhere, once the engine stops); see SwitchRole."""
        config = self.config
        started = self.clock.now()
        assert self.rollout is not None
        phases: dict[str, float] = {}
        self.publish(CellDraining(self.name))
        await self._publish_load()
        # A satellite builds its trainer while the sessions move: the two overlap on separate threads.
        building = (asyncio.ensure_future(self._timed(phases, "trainer_built_s", self._build_trainer()))
                    if self.training is None else None)
        try:
            await self._settle_engine_weights()
            paused = await self._timed(phases, "paused_s", self.rollout.pause_in_place())
            in_flight = await self.rollout.live_sequences()
            migrated = (await self._timed(phases, "migrated_s", self._migrate(targets, in_flight))) if targets else 0
            aborted = await self._timed(phases, "engine_released_s", self.rollout.shutdown())
            self.rollout.drop_pull_buffer()
        finally:
            if building is not None:
                await building
        assert self.training is not None
        if not config.is_core:
            await self._timed(phases, "weights_s", self.catch_up_trainer(always_ask=True))
        self.log.info("drained", paused=paused, sessions_migrated=migrated, aborted=aborted,
                      **{k: round(v, 4) for k, v in phases.items()})
        self.tell(self.name, SwitchFinished(TRAIN, ROLLOUT, "", self.training.version, self.clock.now() - started,
                                            migrated))

    async def _migrate(self, targets: dict[str, str], in_flight: tuple[tuple[int, ...], ...]) -> int:
        """Ask the KV migrator to move this cell's sessions, the partial output of the generations paused in place
        (`in_flight`) included; 0 (and a warning) if it cannot: the proxy then re-prefills the aborted calls on other
        cells, slower but nothing is lost."""
        assert self.rollout is not None
        request = MigrateSessions(self.name, self.rollout.url, targets, (), in_flight)
        try:
            reply: SessionsMigrated = await self.ask(self.config.migrator, request,
                                                     timeout_s=self.config.migrate_timeout_s)
        except GyreError as error:
            self.log.warning("migration_failed_reprefill", error=str(error))
            return 0
        self.log.info("sessions_migrated", sessions=len(reply.placement), moved_tokens=reply.moved_tokens,
                      reprefill=reply.reprefill_sessions, seconds=round(reply.seconds, 4))
        return len(reply.placement)

    async def _train_to_rollout(self) -> None:
        started = self.clock.now()
        assert self.rollout is not None
        phases: dict[str, float] = {}
        preparing = asyncio.ensure_future(self._timed(phases, "engine_memory_s", self.rollout.prepare()))
        try:
            await self._timed(phases, "claims_halted_s", self._halt_claims())
            if not self.config.is_core and self.training is not None:
                if not await self._timed(phases, "gradients_flushed_s", self.claims.flush()):
                    self.log.error("gradients_not_taken_before_release")
                released = self.clock.now()
                self._release_trainer()
                phases["trainer_released_s"] = self.clock.now() - released
        finally:
            await preparing
        weights, version = await self._timed(phases, "weights_s", self._newest_engine_weights())
        await self._timed(phases, "server_s", self.rollout.start(weights, version))
        version = self.rollout.weight_version
        self.tell_broker(WeightsLoaded(self.name, version, self.clock.now() - started))
        self.log.info("back_to_rollout", **{k: round(v, 4) for k, v in phases.items()})
        self.tell(self.name, SwitchFinished(ROLLOUT, TRAIN, self.rollout.url, version, self.clock.now() - started, 0))

    def _release_trainer(self) -> None:
        """Drop a satellite's trainer. Reference counting frees its buffers at once; a full gc pass (0.4 s of a
        stalled event loop with megatron imported) runs only if something still holds them."""
        host, self.training = self.training, None
        assert host is not None
        host.close()
        params = weakref.ref(host.params)
        del host
        if params() is not None:
            gc.collect()
            self.log.warning("trainer_needed_gc", freed=params() is None)

    async def _timed(self, phases: dict[str, float], name: str, work: Any) -> Any:
        """Await `work` and note how long it took under `name` (the switch's phase timings, for its log line)."""
        started = self.clock.now()
        result = await work
        phases[name] = self.clock.now() - started
        return result

    async def _publish_load(self) -> None:
        now = self.clock.now()
        stats = None
        if self.role == ROLLOUT and self.rollout is not None and self.rollout.serving:
            stats = await self.rollout.stats()
        if stats is not None:
            report = LoadReport(
                cell=self.name, role=self.role, engine_url=self.engine_url,
                live_sessions=max(self.sessions.count(), stats.running + stats.waiting),
                running_requests=stats.running, waiting_requests=stats.waiting,
                free_kv_blocks=stats.free_blocks, total_kv_blocks=stats.total_blocks,
                capacity_requests=self.config.engine.max_running_requests,
                weight_version=stats.weight_version, time_s=now,
            )
        else:
            report = LoadReport(self.name, self.role, "", 0, 0, 0, 0, 0, 0, self._weight_version(), now)
        self.publish(report)

    def _weight_version(self) -> int:
        if self.role == ROLLOUT and self.rollout is not None:
            return self.rollout.weight_version
        return self.training.version if self.training is not None else -1

    # ---- handlers -----------------------------------------------------------------------------------------

    @handler(SwitchRole)
    def on_switch_role(self, msg: SwitchRole) -> None:
        if msg.cell != self.name:
            self.log.warning("switch_for_another_cell", cell=msg.cell)
            return
        if msg.role not in ROLES:
            self.log.error("switch_to_unknown_role", role=msg.role)
            return
        if self.role == SWITCHING:
            self.pending_switch = msg  # the newest wish wins; applied when the current switch ends
            self.log.info("switch_deferred", role=msg.role, reason=msg.reason)
            return
        if msg.role == self.role:
            self.log.debug("switch_noop", role=msg.role)
            return
        self._begin_switch(msg)

    @handler(SwitchFinished)
    async def on_switch_finished(self, msg: SwitchFinished) -> None:
        self.role = msg.role
        self.engine_url = msg.engine_url
        if msg.previous_role:
            self.switches += 1
        self.publish(RoleChanged(self.name, msg.role, msg.previous_role, msg.engine_url, msg.weight_version,
                                 msg.switch_s, msg.sessions_migrated, self.config.is_core))
        self.log.info("role_changed", role=msg.role, previous=msg.previous_role, switch_s=round(msg.switch_s, 4),
                      url=msg.engine_url, weight_version=msg.weight_version)
        if msg.role == TRAIN:
            self._start_claiming()
        else:
            self._follow_engine_weights()
        await self._publish_load()
        pending, self.pending_switch = self.pending_switch, None
        if pending is not None and pending.role != self.role:
            self._begin_switch(attrs.evolve(pending, reason=f"deferred while switching: {pending.reason}"))

    @handler(ReportTick)
    async def on_report_tick(self, msg: ReportTick) -> None:
        await self._publish_load()
        self.send_later(self.config.report_interval_s, ReportTick())

    @handler(RoleChanged)
    def on_role_changed(self, msg: RoleChanged) -> None:
        self.peers.on_role_changed(msg)
        if self.core_steps is not None and msg.cell != self.name and (msg.role != TRAIN or not msg.previous_role):
            self.core_steps.forget_cell(msg.cell)

    @handler(LoadReport)
    def on_load_report(self, msg: LoadReport) -> None:
        self.peers.on_load(msg)

    @handler(CellDraining)
    def on_cell_draining(self, msg: CellDraining) -> None:
        self.peers.on_draining(msg)

    @handler(SessionPlaced)
    def on_session_placed(self, msg: SessionPlaced) -> None:
        if msg.cell == self.name:
            self.sessions.seen(msg.session)

    @handler(ModelCallCompleted)
    def on_model_call_completed(self, msg: ModelCallCompleted) -> None:
        # An embedded engine's server notes each call's session as it arrives; a server engine runs in another
        # process, so the cell learns its sessions from the proxy's record of each call it served.
        if msg.cell == self.name and self.config.engine_kind != EMBEDDED:
            self.sessions.seen(msg.execution_id)

    @handler(ExecutionEnded)
    def on_execution_ended(self, msg: ExecutionEnded) -> None:
        self.sessions.ended(msg.execution_id)

    @handler(WeightsPublished)
    def on_weights_published(self, msg: WeightsPublished) -> None:
        self._heard_of(msg.version)
        if not self.config.is_core:
            self._follow_engine_weights()

    @handler(ClaimsOpen)
    def on_claims_open(self, msg: ClaimsOpen) -> None:
        self.claims.wake()

    @handler(StepReady)
    async def on_step_ready(self, msg: StepReady) -> None:
        self._heard_of(msg.base_version)
        if self.config.is_core:
            await self.core_ready.wait()
            assert self.core_steps is not None
            if self.core_steps.on_ready(msg):
                await self._apply_ready_steps()
                self._maybe_round()
            elif self.last_applied is not None and self.last_applied.step_id == msg.step_id:
                # The claimer announces a step again when its StepApplied has not come: it was lost on the way.
                self.tell(self.config.claimer, self.last_applied)

    @handler(MicroStepDone)
    async def on_microstep_done(self, msg: MicroStepDone) -> None:
        if not self.config.is_core:
            self.log.error("microstep_done_sent_to_satellite", from_cell=msg.cell, step_id=msg.step_id)
            return
        await self.core_ready.wait()
        assert self.core_steps is not None
        if await self.core_steps.on_done(msg):
            await self._apply_ready_steps()
            self._maybe_round()

    # ---- gradient reduction rounds (actors/cells/train_role.py says how they go) ------------------------------

    @handler(GradientsHeld)
    async def on_gradients_held(self, msg: GradientsHeld) -> None:
        if not self.config.is_core:
            self.log.error("gradients_held_sent_to_satellite", from_cell=msg.cell, step_id=msg.step_id)
            return
        await self.core_ready.wait()
        assert self.core_steps is not None
        if self.core_steps.on_held(msg):
            self._maybe_round()

    @handler(FlushGradients)
    async def on_flush_gradients(self, msg: FlushGradients) -> RoundEnded:
        await self.core_ready.wait()
        assert self.core_steps is not None
        ended = await self.core_steps.flush(msg)
        await self._apply_ready_steps()
        self._maybe_round()
        return ended

    @handler(JoinReduction)
    def on_join_reduction(self, msg: JoinReduction) -> None:
        # A task: the mailbox stays free while the round waits for the compute lock and for its peers.
        self.spawn(self.claims.join_round(msg, self.training), name=f"{self.name}.round{msg.round_id}")

    @handler(RoundEnded)
    async def on_round_ended(self, msg: RoundEnded) -> None:
        await self.claims.on_round_ended(msg)

    def _maybe_round(self) -> None:
        """Core: start a reduction round when one is due and none is under way."""
        if self.core_steps is None or (self._round_task is not None and not self._round_task.done()):
            return
        if self.core_steps.round_members():
            self._round_task = self.spawn(self.guarded(self._round()), name=f"{self.name}.round")

    async def _round(self) -> None:
        assert self.core_steps is not None
        ended = await self.core_steps.run_round()  # its members are settled when its turn comes
        self.tell(self.name, RoundFinished(ended.round_id if ended else 0))

    @handler(RoundFinished)
    async def on_round_finished(self, msg: RoundFinished) -> None:
        await self._apply_ready_steps()
        self._maybe_round()

    @handler(WeightsDigestAsked)
    async def on_weights_digest_asked(self, msg: WeightsDigestAsked) -> WeightsDigest:
        if self.training is not None:
            async with self.compute_lock:  # no step or pull changes the weights while they are hashed
                version = self.training.version
                digest = await self.offload(self.training.digest)
            return WeightsDigest(self.name, version, digest)
        rollout = self.rollout
        if rollout is not None and rollout.pulled_version >= 0 and rollout.pulled_version == rollout.weight_version:
            return WeightsDigest(self.name, rollout.pulled_version, await self.offload(rollout.pulled_digest))
        return WeightsDigest(self.name, self._weight_version(), "")

    def statistics(self) -> CellStatistics:
        return CellStatistics(
            cell=self.name,
            role=self.role,
            is_core=self.config.is_core,
            engine_url=self.engine_url,
            weight_version=self._weight_version(),
            microsteps_computed=self.claims.computed,
            microsteps_released=self.claims.released,
            steps_applied=self.core_steps.steps_applied if self.core_steps else 0,
            switches=self.switches,
            switches_refused=self.switches_refused,
            has_trainer=self.training is not None,
            has_engine_memory=self.rollout is not None and self.rollout.has_memory,
            engine_kind=self.config.engine_kind,
            engine_weight_updates=self.engine_weight_updates,
            engine_weight_updates_refused=self.engine_weight_updates_refused,
            last_weight_update_path=self.last_weight_update_path,
            last_weight_update_s=self.last_weight_update_s,
            **self._gradient_round_statistics(),
        )

    def _gradient_round_statistics(self) -> dict[str, int]:
        steps, claims = self.core_steps, self.claims
        if steps is not None:
            return dict(gradient_rounds=steps.rounds, gradient_rounds_failed=steps.rounds_failed,
                        gradient_bytes_sent=0, gradient_bytes_received=steps.bytes_received)
        return dict(gradient_rounds=claims.rounds_joined + claims.rounds_failed,
                    gradient_rounds_failed=claims.rounds_not_counted, gradient_bytes_sent=claims.bytes_sent,
                    gradient_bytes_received=claims.bytes_received)
