"""The cell's parts: its view of peers, the core's step bookkeeping, the weight broker, the fenced weight pull, the
trainer host's gradient and weight moves (real trainers, real Mooncake), and the cell actor's switch rules (refusal,
deferral, handing a micro-step back, a bad micro-step) against a scripted claimer."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import socket
import types

import attrs
import pytest
import torch

from gyre.actors.cells.cell import Cell, CellConfig
from gyre.actors.cells.kv_migrator import KVMigratorConfig
from gyre.actors.cells.rollout_role import PeerView, RecentSessions
from gyre.actors.cells.train_role import (
    ClaimLoop,
    ClaimSettings,
    CoreSteps,
    GradientBufferError,
    StepTracker,
    TrainerHost,
    decode_held,
    encode_held,
    join_round,
)
from gyre.actors.cells.weight_broker import NO_SOURCE, WeightBroker, WeightBrokerConfig
from gyre.actors.cells.weight_pull import (
    StaleWeights,
    WeightLayoutError,
    WeightPuller,
    WeightsUnavailable,
    flat_to_hf,
    pull_weights,
    source_from_layout,
)
from gyre.actors.errors import ActorError
from gyre.engines.embedded_engine import EngineConfig
from gyre.engines.grad_exchange import ReductionMember
from gyre.engines.trainer import ParamSlot, TrainerConfig
from gyre.engines.transfer import TransferAgent
from gyre.messages.cell_internal import WeightsDigest, WeightsDigestAsked, WeightsQuery
from gyre.messages.gradient_rounds import GradientsHeld, JoinReduction, RoundEnded
from gyre.messages.cells import ROLLOUT, SWITCHING, TRAIN, CellDraining, LoadReport, RoleChanged, SwitchRole
from gyre.messages.runtime_control import StatisticsAsked
from gyre.messages.samples import TrainingSample
from gyre.messages.training import (
    ClaimGranted,
    ClaimMicroStep,
    MicroStepDone,
    ReleaseMicroStep,
    StepApplied,
    StepReady,
    WeightsLoaded,
    WeightsPublished,
)
from gyre.policies.loss import loss_from_samples, pack_samples
from gyre.runtime import Actor, Topology, UnknownAddress, handler
from gyre.runtime.errors import ConfigError
from gyre.runtime.testing import run_actors

VOCAB = 2041


def role_changed(cell: str, role: str, url: str = "") -> RoleChanged:
    return RoleChanged(cell, role, "", url, 0, 0.0, 0, False)


def load(cell: str, role: str, url: str = "") -> LoadReport:
    return LoadReport(cell, role, url, 0, 0, 0, 0, 0, 0, 0, 0.0)


def done(step: int, index: int, cell: str = "core") -> MicroStepDone:
    return MicroStepDone(cell, step, index, "", 0, 0, 10, 0.5)


def sample(seed: int, n: int = 24, execution: str = "e", token: int | None = None) -> TrainingSample:
    g = torch.Generator().manual_seed(seed)
    ids = tuple(int(t) for t in torch.randint(1, VOCAB, (n,), generator=g)) if token is None else (token,) * n
    mask = tuple(t >= n // 2 for t in range(n))
    k = sum(mask)
    return TrainingSample(
        execution_id=execution, group_id="g", trajectory_rank=0, trajectory_kind="main", leaf_call_index=0,
        token_ids=ids, loss_mask=mask, behaviour_logprobs=tuple(-7.0 if m else 0.0 for m in mask),
        advantages=(1.0,) * n, weights=tuple(1.0 / k if m else 0.0 for m in mask), min_weight_version=0,
        max_weight_version=0, num_loss_tokens=k, sampling_temperatures=(1.0,) * n,
    )


# ---- config and peers ----------------------------------------------------------------------------------------------


def test_config_refuses_bad_values(tiny_model_dir):
    with pytest.raises(ValueError):
        CellConfig(model_dir=str(tiny_model_dir), initial_role="switching")
    with pytest.raises(ValueError):
        CellConfig(model_dir=str(tiny_model_dir), report_interval_s=0.0)
    with pytest.raises(ValueError):
        CellConfig(model_dir=str(tiny_model_dir), pull_attempts=0)
    with pytest.raises(ValueError):
        CellConfig(model_dir=str(tiny_model_dir), checkpoint_every_steps=0)
    with pytest.raises(ValueError, match="average_decay"):  # nothing to save without an average
        CellConfig(model_dir=str(tiny_model_dir), is_core=True, average_save_dir="/tmp/average")
    with pytest.raises(ConfigError):
        WeightBrokerConfig(max_cells=0)
    with pytest.raises(ConfigError, match="max_clients"):  # a migration holds a source's client and a target's
        KVMigratorConfig(max_clients=1)
    with pytest.raises(ConfigError):
        KVMigratorConfig(max_concurrent=0)


def test_the_wings_errors_are_actor_errors_and_keep_their_builtins():
    assert issubclass(StaleWeights, ActorError)
    assert issubclass(WeightsUnavailable, ActorError) and issubclass(WeightsUnavailable, RuntimeError)
    assert issubclass(WeightLayoutError, ActorError) and issubclass(WeightLayoutError, ValueError)
    assert issubclass(GradientBufferError, ActorError) and issubclass(GradientBufferError, ValueError)


class _CheckpointingCore:
    """What CoreSteps.save_checkpoint is given by a core cell: a trainer host, the lock, offload and a log."""

    def __init__(self, model_dir, checkpoint_dir) -> None:
        from gyre.engines.trainer import MegatronTrainer

        self.logged: list[tuple[str, dict]] = []
        log = types.SimpleNamespace(info=lambda event, **kw: self.logged.append((event, kw)),
                                    error=lambda event, **kw: self.logged.append((event, kw)))
        self.steps = CoreSteps(types.SimpleNamespace(trainer=MegatronTrainer(model_dir)), me="core",
                               claimer="claimer", checkpoint_dir=str(checkpoint_dir), compute_lock=asyncio.Lock(),
                               offload=self.offload, send=self.send, log=log)

    async def offload(self, fn, *args):
        return await asyncio.to_thread(fn, *args)

    async def send(self, to, msg):
        raise AssertionError(f"a checkpoint sends nothing, yet {msg!r} went to {to}")


def _round_ledger() -> CoreSteps:
    log = types.SimpleNamespace(info=lambda *a, **k: None, warning=lambda *a, **k: None)
    return CoreSteps(types.SimpleNamespace(), me="core", claimer="claimer", checkpoint_dir="",
                     compute_lock=asyncio.Lock(), offload=None, send=None, log=log)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def held(cell, index, after_round=0, step=0):
    return GradientsHeld(cell, step, index, 10, 0.5, after_round)


def test_a_round_is_due_once_every_micro_step_of_the_step_is_in_computed_or_held():
    steps = _round_ledger()
    assert steps.on_held(held("a", 0)) and steps.on_held(held("b", 1))
    assert steps.round_members() == ()  # the step's size is not known yet
    steps.on_ready(StepReady(0, 4, 4, 4, 0))
    steps.tracker.reserve(0, 2)  # the core computes micro-step 2
    assert steps.round_members() == ()  # micro-step 3 is nobody's yet
    assert steps.on_held(held("b", 3))
    assert steps.round_members() == ("a", "b")
    # A satellite that leaves asks for a round now, with whoever else holds gradients.
    steps.flush_requests.add("c")
    assert steps.round_members() == ("a", "b", "c")
    steps.forget_cell("c")
    steps.forget_cell("a")  # a left training: what it held is the claimer's to re-queue
    assert steps.round_members() == ()


def test_reports_older_than_a_cells_last_round_are_void_and_overlapping_lists_are_not_counted():
    steps = _round_ledger()
    steps.on_ready(StepReady(0, 3, 3, 3, 0))
    steps.last_round_of["a"] = 2
    assert not steps.on_held(held("a", 0, after_round=1))  # round 2 counted it or handed it back
    assert steps.on_held(held("a", 0, after_round=2))
    steps.tracker.accept(done(0, 1, cell="core"), own=True)
    assert not steps.on_held(held("b", 1))  # in already
    lists = [[done(0, 0, cell="a")], [done(0, 2, cell="b")]]
    assert steps._check_lists(("a", "b"), lists) == ""
    assert "two members" in steps._check_lists(("a", "b"), [[done(0, 0, cell="a")], [done(0, 0, cell="b")]])
    assert "in already" in steps._check_lists(("a",), [[done(0, 1, cell="a")]])
    assert "outside" in steps._check_lists(("a",), [[done(0, 5, cell="a")]])


def test_a_checkpoint_is_a_model_directory_and_a_failed_one_is_logged(tiny_model_dir, tmp_path):
    core = _CheckpointingCore(tiny_model_dir, tmp_path / "checkpoints")
    asyncio.run(core.steps.save_checkpoint(7))
    assert (tmp_path / "checkpoints" / "v00007" / "model.safetensors").is_file()
    assert core.logged[-1][0] == "checkpoint_saved"
    # A checkpoint directory that cannot be made (a file is in the way) is logged; training is not stopped.
    (tmp_path / "blocked").write_text("not a directory")
    core = _CheckpointingCore(tiny_model_dir, tmp_path / "blocked")
    asyncio.run(core.steps.save_checkpoint(8))
    event, fields = core.logged[-1]
    assert event == "checkpoint_failed" and fields["version"] == 8 and fields["error"]


def test_peer_view_targets_only_serving_cells_that_do_not_drain():
    view = PeerView("me")
    view.on_role_changed(role_changed("me", ROLLOUT, "http://me"))
    view.on_role_changed(role_changed("a", ROLLOUT, "http://a"))
    view.on_role_changed(role_changed("b", ROLLOUT, "http://b"))
    view.on_role_changed(role_changed("t", TRAIN))
    view.on_load(load("c", ROLLOUT, ""))  # no server yet: not a target
    assert view.rollout_targets() == {"a": "http://a", "b": "http://b"}
    view.on_draining(CellDraining("a"))
    view.on_load(load("a", ROLLOUT, "http://a"))  # a late report does not undo the draining
    assert view.rollout_targets() == {"b": "http://b"}
    view.on_load(load("b", SWITCHING))
    assert view.rollout_targets() == {}
    view.on_role_changed(role_changed("a", ROLLOUT, "http://a2"))  # back: serving again, maybe elsewhere
    assert view.rollout_targets() == {"a": "http://a2"}


def test_recent_sessions_count_executions_seen_within_the_ttl():
    now = [0.0]
    sessions = RecentSessions(ttl_s=10.0, max_sessions=3, clock=lambda: now[0])
    sessions.seen("exec-1/0")
    sessions.seen("exec-1/1#resume1")  # the same execution
    sessions.seen("exec-2/main")  # a session key placed by the migrator
    assert sessions.count() == 2
    now[0] = 8.0
    sessions.seen("exec-3/0")
    now[0] = 12.0  # exec-1 and exec-2 went quiet more than ttl ago
    assert sessions.count() == 1
    for i in range(4, 8):
        sessions.seen(f"exec-{i}/0")
    assert sessions.count() == 3  # bounded: the stalest forgotten
    sessions.clear()
    assert sessions.count() == 0


def test_recent_sessions_forget_an_execution_as_soon_as_it_ends():
    now = [0.0]
    sessions = RecentSessions(ttl_s=600.0, max_sessions=10, clock=lambda: now[0])
    for i in range(3):
        sessions.seen(f"g.{i}/0")
    sessions.ended("g.1")
    sessions.ended("g.9")  # never seen here (its calls went to another cell): nothing happens
    assert sessions.count() == 2
    sessions.seen("g.1/1")  # a late call (a resumed generation) makes it live again until it ends again
    assert sessions.count() == 3


# ---- the core's step bookkeeping ---------------------------------------------------------------------------------


def test_step_tracker_applies_a_step_once_all_its_micro_steps_are_in():
    tracker = StepTracker()
    assert tracker.accept(done(0, 1)) and tracker.accept(done(0, 0))
    assert tracker.next_complete() is None  # the step's size is not known yet
    assert tracker.on_ready(StepReady(0, 3, 3, 3, 0))
    assert tracker.next_complete() is None
    assert not tracker.accept(done(0, 1))  # duplicate
    assert not tracker.accept(done(0, 3))  # outside the step
    assert tracker.accept(done(0, 2))
    progress = tracker.next_complete()
    assert progress is not None and progress.step_id == 0 and sorted(progress.done) == [0, 1, 2]
    tracker.mark_applied(0)
    assert tracker.next_complete() is None
    assert not tracker.accept(done(0, 0)) and not tracker.on_ready(StepReady(0, 3, 3, 3, 0))  # applied


def test_step_tracker_forgets_lost_gradients_and_keeps_steps_in_order():
    tracker = StepTracker()
    tracker.on_ready(StepReady(0, 1, 1, 1, 0))
    tracker.on_ready(StepReady(1, 1, 1, 1, 1))
    assert tracker.accept(done(1, 0))
    assert tracker.next_complete() is None  # step 1 is complete but step 0 comes first
    assert tracker.accept(done(0, 0))
    tracker.forget(0, 0)  # its gradients never arrived
    assert tracker.next_complete() is None
    assert tracker.accept(done(0, 0))
    assert tracker.next_complete().step_id == 0
    tracker.mark_applied(0)
    assert tracker.next_complete().step_id == 1


def test_step_tracker_keeps_the_cores_own_micro_step_from_being_added_twice():
    tracker = StepTracker()
    tracker.on_ready(StepReady(0, 2, 2, 2, 0))
    assert tracker.reserve(0, 0)
    assert not tracker.reserve(0, 0)
    assert not tracker.accept(done(0, 0, cell="satellite"))  # a re-queued copy: the core's own is in its grads
    assert tracker.accept(done(0, 0), own=True)
    assert tracker.accept(done(0, 1, cell="satellite"))
    assert not tracker.reserve(0, 1)  # already in: the core must not compute it again
    assert not tracker.reserve(0, 2)  # outside the step
    tracker.reserve(1, 0)
    tracker.unreserve(1, 0)  # the core's compute failed: a satellite may bring it
    assert tracker.accept(done(1, 0, cell="satellite"))


def test_step_tracker_is_bounded():
    tracker = StepTracker(max_open_steps=2)
    tracker.accept(done(0, 0))
    tracker.accept(done(1, 0))
    with pytest.raises(ValueError):
        tracker.accept(done(2, 0))


# ---- the weight broker (pure logic: virtual time) ------------------------------------------------------------------


class Listener(Actor):
    subscriptions = (WeightsPublished,)

    async def on_start(self) -> None:
        self.published: list[WeightsPublished] = []

    @handler(WeightsPublished)
    def on_published(self, msg: WeightsPublished) -> None:
        self.published.append(msg)


SOURCE = source_from_layout(
    "core", 0, "127.0.0.1:1234", torch.zeros(6), torch.zeros(1, dtype=torch.int64),
    (ParamSlot("a", (2, 2), 0, 4), ParamSlot("b", (2,), 4, 2)),
)


def test_broker_publishes_each_version_and_keeps_who_loaded_what():
    topology = Topology("broker", seed=0)
    topology.add("weight_broker", WeightBroker, WeightBrokerConfig(max_cells=2))
    topology.add("listener", Listener)

    async def driver(h):
        before = await h.ask("weight_broker", WeightsQuery("x"))
        h.tell("weight_broker", attrs.evolve(SOURCE, nbytes=0))  # refused: no buffer
        h.tell("weight_broker", SOURCE)
        h.publish(StepApplied(0, 1, 0.1, 1.0, 10, 2, 0))
        h.publish(StepApplied(0, 1, 0.1, 1.0, 10, 2, 0))  # not newer: ignored
        h.publish(StepApplied(1, 2, 0.1, 1.0, 10, 2, 0))
        h.publish(StepApplied(2, 2, float("nan"), float("nan"), 10, 2, 0, skipped=True))  # weights unchanged
        for cell, version in (("a", 1), ("b", 2), ("c", 2)):
            h.tell("weight_broker", WeightsLoaded(cell, version, 0.5))
        await h.wait_until(lambda: len(h.actor("listener").published) == 3, what="three publications")
        return before, await h.ask("weight_broker", WeightsQuery("x")), await h.ask("weight_broker",
                                                                                    StatisticsAsked())

    run = run_actors(topology, driver, transport="virtual")
    before, after, status = run.value
    assert before == NO_SOURCE
    assert after == attrs.evolve(SOURCE, version=2)
    assert status.version == 2 and status.published == 3 and status.loads == 3
    assert status.cell_versions == {"b": 2, "c": 2}  # bounded: the oldest report was forgotten
    assert status.last_load_s == {"b": 0.5, "c": 0.5}


def test_broker_without_source_publishes_nothing():
    topology = Topology("broker", seed=0)
    topology.add("weight_broker", WeightBroker)
    topology.add("listener", Listener)

    async def driver(h):
        h.publish(StepApplied(0, 1, 0.1, 1.0, 10, 2, 0))
        await asyncio.sleep(1.0)
        return await h.ask("weight_broker", StatisticsAsked())

    run = run_actors(topology, driver, transport="virtual")
    assert run.value.published == 0 and run.value.version == -1


# ---- the puller's retries (the broker and the copy scripted: they are its outer edges) -----------------------------


class _Log:
    def __init__(self) -> None:
        self.events: list[str] = []

    def __getattr__(self, level):
        return lambda event, **fields: self.events.append(event)


def test_the_puller_retries_a_stale_copy_and_gives_up_boundedly():
    newest = [attrs.evolve(SOURCE, version=2)]
    copies: list[int] = []

    async def ask_source():
        return newest[0]

    async def pull_into(source):
        copies.append(source.version)
        if len(copies) == 1:
            raise StaleWeights(source.version, -1)  # a step was writing: ask again, pull again

    log = _Log()
    puller = WeightPuller(ask_source, "sat", attempts=3, retry_s=0.001, log=log)
    assert asyncio.run(puller.pull(lambda: 0, pull_into)) == newest[0]
    assert copies == [2, 2] and log.events == ["weights_stale_retry"]
    assert asyncio.run(puller.pull(lambda: 2, pull_into)) is None  # nothing newer than what it holds
    assert copies == [2, 2]

    async def always_stale(source):
        raise StaleWeights(source.version, source.version + 1)

    with pytest.raises(WeightsUnavailable, match="sat: no clean weight pull in 3 attempts"):
        asyncio.run(puller.pull(lambda: -1, always_stale))

    async def no_broker():
        raise UnknownAddress("weight_broker")

    assert asyncio.run(WeightPuller(no_broker, "sat", 3, 0.001, log).pull(lambda: -1, always_stale)) is None


# ---- the fenced pull (real Mooncake, two agents) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def agents():
    core, puller = TransferAgent(), TransferAgent()
    yield core, puller
    core.close()
    puller.close()


class Tearing:
    """A transfer agent whose peer runs an optimizer step while the weights are read (the fence moves on)."""

    def __init__(self, agent, fence: torch.Tensor, source) -> None:
        self.agent, self.fence, self.source = agent, fence, source

    def pull_tensor(self, peer, remote_addr, into):
        moved = self.agent.pull_tensor(peer, remote_addr, into)
        if remote_addr == self.source.addr:
            self.fence[0] = self.source.version + 1
        return moved


def test_pull_reads_a_clean_version_or_says_it_is_stale(agents):
    core, puller = agents
    params = torch.arange(4096, dtype=torch.float32)
    fence = torch.full((1,), 3, dtype=torch.int64)
    core.register_tensor(params)
    core.register_tensor(fence)
    into = torch.zeros(4096)
    scratch = torch.zeros(1, dtype=torch.int64)
    puller.register_tensor(into)
    puller.register_tensor(scratch)
    source = source_from_layout("core", 3, core.peer, params, fence, (ParamSlot("w", (4096,), 0, 4096),))
    try:
        assert pull_weights(puller, source, into, scratch) == 4096 * 4
        assert torch.equal(into, params)
        fence[0] = -1  # a step is writing
        with pytest.raises(StaleWeights) as stale:
            pull_weights(puller, source, into, scratch)
        assert stale.value.found == -1
        fence[0] = 3
        with pytest.raises(StaleWeights) as torn:
            pull_weights(Tearing(puller, fence, source), source, into, scratch)
        assert torn.value.found == 4  # the bytes may mix two versions: refused
        with pytest.raises(ValueError):
            pull_weights(puller, source, torch.zeros(10), scratch)
    finally:
        for tensor in (params, fence):
            core.unregister_tensor(tensor)
        for tensor in (into, scratch):
            puller.unregister_tensor(tensor)


# ---- trainer host: gradients and weights between a core and a satellite ------------------------------------------


@pytest.fixture(scope="module")
def hosts(tiny_model_dir, agents):
    torch.set_num_threads(2)
    core_agent, satellite_agent = agents
    config = TrainerConfig(lr=1e-3)
    core = TrainerHost.build(str(tiny_model_dir), config, core_agent, True, torch.zeros(1, dtype=torch.int64))
    satellite_scratch = torch.zeros(1, dtype=torch.int64)
    satellite_agent.register_tensor(satellite_scratch)
    satellite = TrainerHost.build(str(tiny_model_dir), config, satellite_agent, False, satellite_scratch)
    yield core, satellite
    core.close()
    satellite.close()
    satellite_agent.unregister_tensor(satellite_scratch)


def test_flat_weights_convert_to_the_trainers_hf_state_dict(hosts):
    core, _ = hosts
    source = core.source("core")
    converted = flat_to_hf(core.trainer.flat_params(), source, core.trainer.spec)
    expected = core.trainer.hf_state_dict()
    assert converted.keys() == expected.keys()
    assert all(torch.equal(converted[k], expected[k]) for k in expected)


def test_a_micro_step_in_length_sorted_chunks_has_the_gradients_of_one_padded_batch(hosts):
    _, satellite = hosts
    samples = [sample(3, n=40), sample(4, n=10, execution="f"), sample(5, n=24), sample(6, n=12, execution="f")]
    satellite.trainer.zero_grads()
    whole = satellite.compute(samples, 2, 3e-4, 4e-4, 4096)
    expected = satellite.trainer.grads_to_flat().clone()
    satellite.trainer.zero_grads()
    chunked = satellite.compute(samples, 2, 3e-4, 4e-4, 40)  # (10, 12) | (24) | (40)
    assert (whole["chunks"], chunked["chunks"]) == (1, 3)
    assert torch.allclose(satellite.trainer.grads_to_flat(), expected, atol=1e-7)
    assert chunked["loss"] == pytest.approx(whole["loss"], abs=1e-6)
    assert chunked["num_tokens"] == whole["num_tokens"] == 86
    assert chunked["num_loss_tokens"] == whole["num_loss_tokens"] and chunked["num_rows"] == 4
    satellite.trainer.zero_grads()


def test_gradients_reach_the_core_in_a_round_and_weights_move_back(hosts):
    core, satellite = hosts
    samples = [sample(1), sample(2, execution="f")]
    satellite.compute(samples, 2, 3e-4, 4e-4, 4096)
    expected = satellite.trainer.grads_to_flat()
    assert float(expected.abs().sum()) > 0
    member = ReductionMember(timeout_s=60.0)
    join = JoinReduction(1, 1, 1, 2, core.address, core.rendezvous.port, core.numel)
    held = [GradientsHeld("sat", 0, 3, 86, 0.5, 0)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the two sides of one round, as two cells run them
        satellite_side = pool.submit(satellite.reduce_as_member, member, join, encode_held(held))
        moved, payloads = pool.submit(core.reduce_as_core, 1, 1, 2).result(120)
        sent = satellite_side.result(120)
    assert decode_held("sat", payloads[0]) == [MicroStepDone("sat", 0, 3, "", 0, 0, 86, 0.5)]
    assert sent.sent == moved.received == core.numel * 4  # one buffer, once
    assert float(satellite.trainer.grads_to_flat().abs().sum()) == 0  # ready for the next micro-step
    core.trainer.zero_grads()
    core.add_reduced()
    assert torch.equal(core.trainer.grads_to_flat(), expected)
    with pytest.raises(GradientBufferError, match="another model"):
        join_round(member, attrs.evolve(join, numel=core.numel + 1), b"[]", satellite.trainer.grad_buffer())
    # A core of another training layout (tensor-parallel: two lanes): a one-process satellite refuses to join.
    assert (core.layout, core.lane_numels) == ((1, 1, 1, 1), (core.numel,))
    with pytest.raises(GradientBufferError, match="the core trains tp2.pp1.dp1.ep1, this cell tp1.pp1.dp1.ep1"):
        satellite.reduce_as_member(member, attrs.evolve(join, layout=(2, 1, 1, 1), lane_numels=(5, 5)), b"[]")
    with pytest.raises(GradientBufferError, match="another model"):
        satellite.reduce_as_member(member, attrs.evolve(join, lane_numels=(core.numel + 1,)), b"[]")
    for bad in (b"{", b"{}", b'[[0, 1, 2]]', b'[["0", 1, 2, 0.5]]'):
        with pytest.raises(GradientBufferError, match="held list"):
            decode_held("sat", bad)
    member.drop()
    # The same micro-step computed on the core gives the same gradients (the hosts start from the same weights).
    core.trainer.zero_grads()
    batch = pack_samples(samples)
    core.trainer.forward_backward(batch.input_ids, batch.lengths,
                                  lambda lp: loss_from_samples(lp, batch, num_executions=2))
    assert torch.allclose(core.trainer.grads_to_flat(), expected, atol=1e-7)

    result = core.apply_step()
    assert not result["skipped"] and core.version == int(core.fence[0]) == 1
    source = core.source("core")
    satellite.pull(source)
    assert satellite.version == 1 and torch.equal(satellite.params, core.params)
    assert satellite.digest() == core.digest()
    with pytest.raises(StaleWeights):
        satellite.pull(attrs.evolve(source, version=0))  # the core moved on: never passes for version 0
    assert satellite.version == -1
    satellite.pull(source)
    assert satellite.version == 1
    # A core whose weights are sharded (TP=2): a one-process trainer cannot pull them whole, and says why.
    sharded = attrs.evolve(source, shards=((source.peer, source.addr, 8), (source.peer, source.addr, 8)),
                           layout=(2, 1, 1, 1))
    with pytest.raises(WeightLayoutError, match="sharded over 2 ranks \\(tp2.pp1.dp1.ep1\\)"):
        satellite.pull(sharded)
    # Data parallel alone keeps a whole replica on every rank: a one-process trainer pulls rank 0's, as from a
    # one-process core (a rollout cell's staging pull beside a DP core goes the same way).
    # Expert parallelism takes its ranks out of the data-parallel ones: rank 0 then holds only its own experts.
    with pytest.raises(WeightLayoutError, match="sharded over 2 ranks \\(tp1.pp1.dp2.ep2\\)"):
        satellite.pull(attrs.evolve(source, shards=((source.peer, source.addr, 8),) * 2, layout=(1, 1, 2, 2)))
    replicated = attrs.evolve(source, shards=((source.peer, source.addr, source.nbytes),) * 2, layout=(1, 1, 2, 1))
    satellite.params.zero_()
    satellite.pull(replicated)
    assert satellite.version == 1 and torch.equal(satellite.params, core.params)
    assert source.shards == () and source.layout == (1, 1, 1, 1)  # a one-process core's source


class CannotRegisterLargeBuffers(TransferAgent):
    """A real agent that says it cannot register anything larger than a fence: what a Mooncake build without CUDA
    says of device parameters (this machine has no GPU, so host memory stands in for them)."""

    def can_register(self, buffer) -> bool:
        return buffer.numel() <= 1


def test_a_core_whose_parameters_cannot_be_registered_serves_a_host_copy_under_the_fence(tiny_model_dir, agents):
    _, satellite_agent = agents
    scratch = torch.zeros(1, dtype=torch.int64)
    satellite_agent.register_tensor(scratch)
    with CannotRegisterLargeBuffers() as core_agent:
        core = TrainerHost.build(str(tiny_model_dir), TrainerConfig(lr=1e-3), core_agent, True,
                                 torch.zeros(1, dtype=torch.int64))
        satellite = TrainerHost.build(str(tiny_model_dir), TrainerConfig(), satellite_agent, False, scratch)
        try:
            assert core.served is not core.params and torch.equal(core.served, core.params)
            registered = core_agent.statistics().registered_bytes
            assert registered == core.served.numel() * 4 + 8  # the host copy and the fence, not the parameters
            batch = pack_samples([sample(1), sample(2, execution="f")])
            core.trainer.forward_backward(batch.input_ids, batch.lengths,
                                          lambda lp: loss_from_samples(lp, batch, num_executions=2))
            core.apply_step()
            source = core.source("core")
            assert source.addr == core.served.data_ptr() and source.version == 1 == int(core.fence[0])
            satellite.pull(source)  # the step's weights, from the host copy
            assert satellite.version == 1 and torch.equal(satellite.params, core.params)
            assert satellite.digest() == core.digest()
            # Weights that change outside a step (a restored checkpoint) reach the copy before the next source.
            core.trainer.load_flat_params(core.trainer.flat_params() * 0.5, version=7)
            satellite.pull(core.source("core"))
            assert satellite.version == 7 and torch.equal(satellite.params, core.params)
        finally:
            core.close()
            satellite.close()
            satellite_agent.unregister_tensor(scratch)


def test_a_round_whose_member_never_joins_counts_nothing_and_its_micro_steps_go_back(tiny_model_dir, agents):
    """The core's side against a satellite that never comes (dead, or gone): bounded by the group's timeout, the
    round counts nothing, the member hears RoundEnded(counted=False), the next round forms a new group; on the
    satellite's side a round that was not counted hands back what it brought."""
    core_agent, _ = agents
    host = TrainerHost.build(str(tiny_model_dir), TrainerConfig(), core_agent, True,
                             torch.zeros(1, dtype=torch.int64), "127.0.0.1", reduce_timeout_s=1.0)
    sent: list = []

    async def send(to, msg):
        sent.append((to, msg))

    async def offload(fn, *args):
        return await asyncio.to_thread(fn, *args)

    log = types.SimpleNamespace(info=lambda *a, **k: None, warning=lambda *a, **k: None,
                                error=lambda *a, **k: None)
    steps = CoreSteps(host, me="core", claimer="claimer", checkpoint_dir="", compute_lock=asyncio.Lock(),
                      offload=offload, send=send, log=log)
    steps.on_ready(StepReady(0, 2, 2, 2, 0))
    assert steps.on_held(held("sat", 0)) and steps.on_held(held("sat", 1))

    async def two_rounds():
        first = await steps.run_round()
        group = steps.group_id
        second = await steps.run_round(("sat",))
        return first, group, second

    try:
        first, group, second = asyncio.run(two_rounds())
    finally:
        host.close()
    assert not first.counted and "did not form" in first.reason and first.round_id == 1
    assert (steps.group_id, group) == (2, 1)  # a failed group is never reused
    joins = [m for to, m in sent if isinstance(m, JoinReduction)]
    assert [(j.round_id, j.group_id, j.rank, j.size, j.numel) for j in joins] == [
        (1, 1, 1, 2, host.numel), (2, 2, 1, 2, host.numel)]
    assert [(to, m) for to, m in sent if to == "sat" and not isinstance(m, JoinReduction)] == [
        ("sat", first), ("sat", second)]
    assert not [m for to, m in sent if to == "claimer"]  # nothing counted
    assert not steps.tracker.open[0].done and not steps.marks["sat"]  # the reports are void now
    assert not steps.on_held(held("sat", 0, after_round=0))
    assert steps.history[-1].counted is False and steps.rounds_failed == 2

    # The satellite's side: what it brought to a round that was not counted goes back to the claimer.
    released: list = []

    async def satellite_send(to, msg):
        released.append((to, msg))

    settings = ClaimSettings(cell="sat", is_core=False, claimer="claimer", core="core", claim_timeout_s=1.0,
                             claim_retry_s=0.1, grads_taken_timeout_s=1.0, clip_low=3e-4, clip_high=4e-4,
                             chunk_padded_tokens=2048, reduce_timeout_s=1.0)
    claims = ClaimLoop(settings, ask=None, send=satellite_send, offload=offload, compute_lock=asyncio.Lock(), log=log)
    claims.held = [held("sat", 0), held("sat", 1)]
    port = free_port()  # nobody listens: the join fails within its timeout

    async def satellite():
        await claims.join_round(JoinReduction(3, 3, 1, 2, "127.0.0.1", port, 64), None)
        await claims.on_round_ended(RoundEnded(3, False, 0, "test"))
        return await claims.flush()

    flushed = asyncio.run(satellite())
    claims.close()
    assert flushed and claims.rounds_failed == 1 and claims.last_round == 3 and not claims.held
    assert [(to, m.step_id, m.microstep_index) for to, m in released] == [("claimer", 0, 0), ("claimer", 0, 1)]


def test_a_claim_loop_pausing_for_lack_of_work_claims_again_when_the_claimer_wakes_it():
    asks: list = []

    async def ask(to, msg, timeout_s):
        asks.append(msg)
        return ClaimGranted(-1, -1, (), 0, 3600.0)  # nothing, and a poll an hour away

    settings = ClaimSettings(cell="sat", is_core=False, claimer="claimer", core="core", claim_timeout_s=1.0,
                             claim_retry_s=0.1, grads_taken_timeout_s=1.0, clip_low=3e-4, clip_high=4e-4,
                             chunk_padded_tokens=2048, reduce_timeout_s=1.0)
    log = types.SimpleNamespace(warning=lambda *a, **k: None, error=lambda *a, **k: None)
    claims = ClaimLoop(settings, ask=ask, send=None, offload=None, compute_lock=asyncio.Lock(), log=log)

    host = types.SimpleNamespace(version=0)  # a trainer host: only its weight version is read before the grant

    async def main():
        pausing = asyncio.ensure_future(claims.claim_once(host, None))
        await asyncio.sleep(0.05)
        assert not pausing.done()
        claims.wake()
        await asyncio.wait_for(pausing, 10.0)  # the hour's pause ended with the wake-up
        claims.wake()  # a wake-up that comes while a claim is on its way ends the next pause at once
        await asyncio.wait_for(claims.claim_once(host, None), 10.0)

    try:
        asyncio.run(main())
    finally:
        claims.close()
    assert len(asks) == 2 and all(a.cell == "sat" for a in asks)


# ---- the cell actor against a scripted claimer ---------------------------------------------------------------------


class ScriptedClaimer(Actor):
    """Grants what the driver queued; with the gate closed a claim waits (so a switch can overtake it)."""

    async def on_start(self) -> None:
        self.grants: collections.deque[ClaimGranted] = collections.deque()
        self.gate = asyncio.Event()
        self.gate.set()
        self.claims: list[ClaimMicroStep] = []
        self.released: list[ReleaseMicroStep] = []

    @handler(ClaimMicroStep)
    async def on_claim(self, msg: ClaimMicroStep) -> ClaimGranted:
        self.claims.append(msg)
        await self.gate.wait()
        if self.grants:
            return self.grants.popleft()
        return ClaimGranted(-1, -1, (), 0, 0.02)

    @handler(ReleaseMicroStep)
    def on_release(self, msg: ReleaseMicroStep) -> None:
        self.released.append(msg)


def test_cell_hands_back_what_it_cannot_train_and_refuses_switches_it_cannot_make(tiny_model_dir):
    engine = EngineConfig(num_blocks=64, max_context_tokens=512, max_prefill_tokens=256, num_threads=1)
    topology = Topology("cell-rules", seed=0)
    topology.add("claimer", ScriptedClaimer)
    topology.add("sat", Cell, CellConfig(model_dir=str(tiny_model_dir), initial_role=TRAIN, engine=engine,
                                         trainer=TrainerConfig(num_threads=1), report_interval_s=0.2))

    async def driver(h):
        claimer = h.actor("claimer")
        claimer.grants.append(ClaimGranted(0, 0, (sample(1, token=10**6),), 1, 0.0))  # ids outside the vocab
        await h.wait_until(lambda: len(claimer.released) == 1, timeout_s=120, what="bad micro-step handed back")
        cell = h.actor("sat")
        assert cell.role == TRAIN and h.status("sat") == "running"
        # A claim that is answered only after the switch began: the grant goes back untouched.
        claimer.gate.clear()
        claimer.grants.append(ClaimGranted(0, 1, (sample(2),), 1, 0.0))
        seen = len(claimer.claims)
        await h.wait_until(lambda: len(claimer.claims) > seen, timeout_s=30, what="a claim waiting")
        h.tell("sat", SwitchRole("other", ROLLOUT, "not for this cell"))
        h.tell("sat", SwitchRole("sat", ROLLOUT, "test"))
        h.tell("sat", SwitchRole("sat", TRAIN, "test: deferred, then refused"))
        await h.wait_until(lambda: cell.role == SWITCHING, what="switching")
        claimer.gate.set()
        await h.wait_until(lambda: cell.role == ROLLOUT, timeout_s=60, what="back to rollout")
        await h.wait_until(lambda: cell.switches_refused == 1, what="deferred switch refused")
        h.tell("sat", SwitchRole("sat", TRAIN, "test: no other rollout cell"))
        await h.wait_until(lambda: cell.switches_refused == 2, what="switch refused")
        refused = await h.ask("sat", StatisticsAsked())
        digests = [await h.ask("sat", WeightsDigestAsked())]
        # The colocate baseline's switch leaves the sessions where they are: no rollout cell is needed to take them.
        h.tell("sat", SwitchRole("sat", TRAIN, "test: colocate", migrate_sessions=False))
        await h.wait_until(lambda: cell.role == TRAIN, timeout_s=60, what="stranding switch into training")
        digests.append(await h.ask("sat", WeightsDigestAsked()))
        return refused, await h.ask("sat", StatisticsAsked()), list(claimer.released), digests

    run = run_actors(topology, driver, timeout_s=240)
    status, stranded, released, digests = run.value
    # No broker: the engine serves the model directory's weights (nothing pulled to hash), the trainer its own.
    assert digests[0] == WeightsDigest("sat", 0, "")
    assert digests[1].weight_version == 0 and len(digests[1].sha256) == 64
    assert [(r.cell, r.step_id, r.microstep_index) for r in released] == [("sat", 0, 0), ("sat", 0, 1)]
    assert status.role == ROLLOUT and status.switches == 1 and status.switches_refused == 2
    assert status.microsteps_computed == 0 and status.microsteps_released == 2
    assert not status.has_trainer and status.has_engine_memory and status.engine_url
    assert stranded.role == TRAIN and stranded.switches == 2 and stranded.switches_refused == 2
    assert stranded.has_trainer and not stranded.engine_url
