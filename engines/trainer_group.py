"""A trainer of several processes, driven from one: the train-role cell's process is rank 0 of a megatron group.

Layout. A `TrainerConfig` whose tensor * pipeline * data sizes exceed 1 makes a `TrainerGroup`: the calling process
(the core cell's) is global rank 0 and starts world_size - 1 worker processes (`python -m gyre.engines.trainer_group`,
one per device: on CUDA rank r uses device r mod count). Every rank joins one torch.distributed group and megatron's
`parallel_state` through `parallel.init_parallel` (gloo on CPU, NCCL on CUDA: the same code) and builds a
`MegatronTrainer` holding its shard. Rank 0 is in data-parallel replica 0 at tensor, pipeline and expert rank 0,
which makes it the publishing rank of `MegatronTrainer.iter_hf_buckets`.

Driving. Each worker has one command pipe to rank 0 (a socket pair inherited at start; pickled (command, args)
frames). A call on the group, under the group's lock (commands never interleave): rank 0 checks the inputs, sends
the command to every worker (each its own arguments where they differ), runs its own part (the collectives meet
there), then reads every worker's reply. Commands: `forward_backward` (the same batch on every rank of a replica;
data-parallel replicas each get their share through `forward_backward_shares`, or replica 0 the whole batch; with
expert parallelism a replica without rows takes `MegatronTrainer.idle_pass`, so its token exchanges meet),
`logprobs`, `optimizer_step` (megatron's reductions, the global-norm clip, AdamW on every shard), `zero_grads`,
`load_shard` (each rank gets only its shard of new weights), `hf_buckets` (every rank iterates the bucket gather in
step; rank 0 receives each bucket, converts it to HF names and hands it on before the next is gathered, so no rank
holds more than its shard plus one bucket), `save_part` / `load_part` (sharded checkpoints: each rank writes and
restores its own file `core.tp<T>.pp<P>.pt`, `core.tp<T>.pp<P>.ep<E>.pt` with expert parallelism, in the checkpoint
folder, through runtime.checkpoint's atomic writes and checksums; the first replica of each shard writes, every
replica reads), `reduce_lane` / `add_lane_sum` / `drop_lanes`
(gradient rounds between cells of one layout, lane by lane: rank g reduces its shard with rank g of the other cells
over a group of its own, engines/grad_exchange.py; `reduce_lanes`), `shard_source` / `pull_shard` (each worker's
own transfer agent with its shard served as rank 0 serves its own, `ServedParams`: registered in place, or, for device
memory that a Mooncake build without CUDA cannot register, a host copy that every command changing the weights
(`optimizer_step`, `load_shard`, `load_part`, `pull_shard`) refreshes before it answers, so inside the caller's fence
window; another cell of the same layout pulls shard g into its rank g: `shard_sources`, `pull_shards`),
`set_version` and `shutdown`.

Failures. Every wait is bounded: the start (`group_start_timeout_s`: spawn, megatron's import, the rendezvous, the
build) and each command (`group_timeout_s`, also the process group's collective timeout). A worker that dies or fails
to start turns the call into `TrainerGroupError` naming the rank, its exit code and the tail of its output (each
worker's stdout and stderr go to a file in the group's temp folder); a dead worker is seen at once (its pipe closes;
gloo sees its sockets close), not after the timeout. A group that failed is unusable (the cell fails and its restart
builds a new one); `close` stops the workers (shutdown, then kill) and leaves the process group.

The surface is MegatronTrainer's where the cell uses it (version, param_buffer, param_layout, forward_backward,
optimizer_step, zero_grads, hf_state_dict, iter_hf_buckets, save_hf, logprobs, load_hf_state_dict), so the cell code
does not branch; flat whole-model gradients (`grad_buffer`, `add_flat_grads`: a round's lanes take their place) and
whole-state checkpoints (`checkpoint_state`) have no meaning for a sharded trainer and raise TrainerError, the
sharded checkpoint being `save_sharded_checkpoint` / `load_sharded_checkpoint`. A process hosts at most one group
(megatron's parallel state is per process), and it must be the process's first torch.distributed group.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Mapping, Sequence

import structlog
import torch

from gyre.engines import parallel
from gyre.engines.errors import EngineError, TrainerError
from gyre.engines.grad_exchange import GradientExchangeError, ReductionBytes, ReductionMember
from gyre.engines.model_format import ModelSpec, load_hf_state_dict, save_model_dir
from gyre.engines.trainer import LossFn, MegatronTrainer, TrainerConfig, checkpoint_state_digest, trainer_device
from gyre.engines.weight_buckets import HFBuckets
from gyre.runtime.errors import ConfigError

__all__ = ["ServedParams", "TrainerGroup", "TrainerGroupCommandError", "TrainerGroupError", "build_trainer",
           "load_part", "save_part"]

log = structlog.get_logger(__name__)

OUTPUT_TAIL_CHARS = 3000
"""How much of a failed worker's output its error quotes."""
_POLL_S = 0.1
_EXIT_GRACE_S = 3.0
"""After rank 0's own part fails, how long it waits for a worker to be seen dead before blaming rank 0's error."""


class TrainerGroupError(EngineError, RuntimeError):
    """A trainer group's worker died, failed to start, failed a command or did not answer in time. A RuntimeError,
    not a ValueError: no caller should treat it as bad input and carry on."""


class TrainerGroupCommandError(TrainerGroupError):
    """Every rank answered, but some failed the command (their error and traceback are in the message; e.g. a full
    disk under one rank's checkpoint file). The group is still in step and usable."""


def build_trainer(model_dir: str | Path, config: TrainerConfig) -> "MegatronTrainer | TrainerGroup":
    """The in-process MegatronTrainer for world size 1, a TrainerGroup for more."""
    if config.parallel.world_size > 1:
        return TrainerGroup(model_dir, config)
    return MegatronTrainer(model_dir, config)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _send(conn: Connection, message: Any) -> None:
    # Plain pickle: tensors travel by value (torch's multiprocessing pickler would pass shared-memory handles).
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - OUTPUT_TAIL_CHARS))
            return handle.read().decode(errors="replace").strip() or "(no output)"
    except OSError as error:
        return f"(output unreadable: {error})"


SERVED_HOW = ("live", "copy", "none")
"""How a rank's parameters are served to peers (`ServedParams.how`)."""


class ServedParams:
    """One rank's parameters as peers pull them through a transfer agent, and as pulls land in them.

    `how` is "live" where the agent can register the parameters (host memory, or device memory with Mooncake's CUDA
    build): peers read them in place, and pulls land in place. Where it cannot (device memory, a build without CUDA)
    a rank that serves (a core's) registers a host copy instead, pinned where CUDA is present ("copy"), and a rank
    that does not ("none": a satellite's) registers nothing, its pulls staged by the agent. A copy holds the weights
    of its last `refresh`: whoever changes the weights refreshes it before the fence shows the new version (the cell's
    TrainerHost for rank 0 of a one-process trainer, the TrainerGroup commands that change weights for every rank of a
    group), so a peer never reads a copy older than the version the fence shows. One choice per cell: rank 0 makes it
    (`choose`) and a group's other ranks, on the same machine with the same Mooncake build, follow it."""

    def __init__(self, params: torch.Tensor, agent: Any, how: str, version: int) -> None:
        if how not in SERVED_HOW:
            raise ValueError(f"how must be one of {SERVED_HOW}, got {how!r}")
        self.params = params
        self.agent = agent
        self.how = how
        self.version = version
        """The trainer version the served buffer holds (a copy's: the version of its last refresh)."""
        self.buffer: torch.Tensor | None = None
        """The registered buffer: the parameters ("live"), their host copy ("copy"), or None ("none")."""
        if how == "live":
            agent.register_tensor(params)
            self.buffer = params
        elif how == "copy":
            copy = torch.empty(params.shape, dtype=params.dtype, pin_memory=torch.cuda.is_available())
            copy.copy_(params)
            agent.register_tensor(copy)
            self.buffer = copy
            log.warning("weights_served_from_host_copy", bytes=copy.numel() * copy.element_size(),
                        reason="the transfer agent cannot register device memory (Mooncake without CUDA): every "
                        "change of the weights copies them to the host; Mooncake's CUDA build serves them in place")

    @staticmethod
    def choose(params: torch.Tensor, agent: Any, serve: bool) -> str:
        """"live" where `agent` can register `params`, else "copy" for a rank that serves peers, "none" for one
        that only pulls."""
        if agent.can_register(params):
            return "live"
        return "copy" if serve else "none"

    def source(self) -> tuple[str, int, int]:
        """(peer, address, bytes) peers pull these weights from: the registered buffer's (the parameters' own where
        nothing is registered: a rank that does not serve, which nobody pulls from)."""
        buffer = self.params if self.buffer is None else self.buffer
        return (self.agent.peer, int(buffer.data_ptr()), buffer.numel() * buffer.element_size())

    def stale(self, version: int) -> bool:
        """Whether a copy holds another version than `version` (the trainer's now)."""
        return self.how == "copy" and self.version != version

    def refresh(self, version: int) -> None:
        """The weights changed (to `version`): bring a copy up to them. The copy is synchronous (no non_blocking):
        the caller sets the fence to the new version right after, and a peer may read the copy from then on."""
        if self.how == "copy":
            assert self.buffer is not None
            with torch.no_grad():
                self.buffer.copy_(self.params)
        self.version = version

    def close(self) -> None:
        """Unregister the buffer (peers' transfers into it fail from now on). Idempotent."""
        if self.buffer is not None:
            self.agent.unregister_tensor(self.buffer)
            self.buffer = None


def _refresh(served: ServedParams | None, trainer: MegatronTrainer) -> None:
    """A command changed this rank's weights: its served copy (if it serves one) takes them before the command
    answers, so inside the fence window of whoever asked for the change."""
    if served is not None:
        served.refresh(trainer.version)


# ---- what every rank runs for a command (rank 0 in the calling process, the others in `_worker_main`) ----------

def save_part(trainer: MegatronTrainer, folder: str) -> tuple[Any, str]:
    """This rank's checkpoint state into `folder/core.tp<T>.pp<P>[.ep<E>].pt` (atomic; only the first replica of each
    shard writes, `parallel.is_first_replica`). Returns (its PartRecord or None where another replica writes, the
    state's digest)."""
    from gyre.runtime.checkpoint import write_file_atomic

    state = trainer.checkpoint_state()
    digest = checkpoint_state_digest(state)
    if not parallel.is_first_replica():
        return None, digest
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return write_file_atomic(Path(folder) / parallel.checkpoint_part_name(), buffer.getvalue()), digest


def load_part(trainer: MegatronTrainer, checkpoint_path: str) -> str:
    """Restore this rank's shard from the committed checkpoint at `checkpoint_path` (its checksum checked);
    returns the restored state's digest."""
    from gyre.runtime.checkpoint import open_checkpoint

    data = open_checkpoint(checkpoint_path).read_part(parallel.checkpoint_part_name())
    state = torch.load(io.BytesIO(data), weights_only=True)
    trainer.load_checkpoint_state(state)
    return checkpoint_state_digest(state)


def _forward_backward(trainer: MegatronTrainer, share: tuple | None) -> dict | None:
    if share is None:  # no rows for this replica: with expert parallelism it still meets its peers' token exchanges
        trainer.idle_pass(backward=True)
        return None
    return trainer.forward_backward(*share)


def _logprobs(trainer: MegatronTrainer, batch: tuple | None) -> torch.Tensor | None:
    if batch is None:
        trainer.idle_pass(backward=False)
        return None
    return trainer.logprobs(*batch)


def _hf_buckets(trainer: MegatronTrainer, bucket_bytes: int, averaged: bool) -> int:
    count = 0
    for bucket in trainer.iter_hf_buckets(bucket_bytes, averaged):
        assert not bucket, "only rank 0 publishes"
        count += 1
    return count


_SNAPSHOT: dict[int, torch.Tensor] = {}
"""This rank's weight snapshot for a publication (`TrainerGroup.publication`), by id: only the newest is kept."""


def _snapshot(trainer: MegatronTrainer, snapshot_id: int, averaged: bool) -> None:
    _SNAPSHOT.clear()
    _SNAPSHOT[snapshot_id] = trainer.averaged_params() if averaged else trainer.flat_params()


def _snapshot_flat(snapshot_id: int) -> torch.Tensor:
    flat = _SNAPSHOT.get(snapshot_id)
    if flat is None:
        raise TrainerError(f"weight snapshot {snapshot_id} is gone (a newer publication replaced it)")
    return flat


def _snapshot_buckets(trainer: MegatronTrainer, snapshot_id: int, bucket_bytes: int) -> int:
    count = 0
    for bucket in trainer.iter_hf_buckets(bucket_bytes, flat=_snapshot_flat(snapshot_id)):
        assert not bucket, "only rank 0 publishes"
        count += 1
    return count


def _set_version(trainer: MegatronTrainer, version: int) -> None:
    trainer.version = version


_SHARD_AGENT: dict[str, Any] = {}
"""A worker's own transfer agent ("agent") and its parameter shard as served through it ("served", a ServedParams):
peers pull that shard from it, and it pulls its shard of a core's weights into it (rank 0 uses its cell's agent and
the cell's ServedParams)."""


def _shard_source(trainer: MegatronTrainer, config: Any, how: str) -> tuple[str, int, int]:
    """This worker's shard as a pull source (peer, address, bytes): its agent started on first use with rank 0's
    TransferConfig `config`, the shard served as rank 0 serves its own (`how`, ServedParams)."""
    from gyre.engines.transfer import TransferAgent

    agent = _SHARD_AGENT.get("agent")
    if agent is None:
        agent = _SHARD_AGENT["agent"] = TransferAgent(config)
    served = _SHARD_AGENT.get("served")
    if served is None:
        served = _SHARD_AGENT["served"] = ServedParams(trainer.param_buffer(), agent, how, trainer.version)
    return served.source()


def _worker_served() -> ServedParams | None:
    return _SHARD_AGENT.get("served")


def pull_shard(trainer: MegatronTrainer, agent: Any, shard: tuple[str, int, int]) -> int:
    """Copy one rank's shard of a peer cell's weights (peer, address, bytes) into this rank's parameters."""
    peer, addr, nbytes = shard
    params = trainer.param_buffer()
    if nbytes != params.numel() * params.element_size():
        raise TrainerError(f"the shard at {peer} holds {nbytes} bytes, this rank's {params.numel() * 4}: another "
                           "layout or model")
    return agent.pull_tensor(peer, addr, params)


def _pull_shard_worker(trainer: MegatronTrainer, shard: tuple[str, int, int]) -> int:
    agent = _SHARD_AGENT.get("agent")
    if agent is None:
        raise TrainerError("this rank has no transfer agent (shard_sources was never called)")
    moved = pull_shard(trainer, agent, shard)
    _refresh(_worker_served(), trainer)
    return moved


def _optimizer_step(trainer: MegatronTrainer, served: ServedParams | None, lr: float | None) -> dict:
    result = trainer.optimizer_step(lr)
    if not result["skipped"]:  # a skipped step leaves the weights as they were
        _refresh(served, trainer)
    return result


def _load_shard(trainer: MegatronTrainer, served: ServedParams | None, shard: Mapping[str, torch.Tensor],
                version: int | None) -> None:
    trainer.load_shard(shard, version)
    _refresh(served, trainer)


def _load_part(trainer: MegatronTrainer, served: ServedParams | None, checkpoint_path: str) -> str:
    digest = load_part(trainer, checkpoint_path)
    _refresh(served, trainer)
    return digest


_LANE: dict[str, Any] = {}
"""This process's side of the gradient rounds' lanes (engines/grad_exchange.py): its ReductionMember ("member",
a worker's own; rank 0 uses its cell's) and, on a core, the scratch its lane's sum lands in ("reduced")."""


def _lane_member(device: str, timeout_s: float) -> ReductionMember:
    member = _LANE.get("member")
    if member is None or member.device != device or member.timeout_s != timeout_s:
        member = _LANE["member"] = ReductionMember(device, timeout_s)
    return member


def _core_scratch(trainer: MegatronTrainer) -> torch.Tensor:
    grads = trainer.grad_buffer()
    reduced = _LANE.get("reduced")
    if reduced is None or reduced.shape != grads.shape or reduced.device != grads.device:
        reduced = _LANE["reduced"] = torch.zeros_like(grads)
    return reduced


def reduce_lane(trainer: MegatronTrainer, member: ReductionMember, lane: int, round_args: tuple) -> ReductionBytes:
    """This rank's lane of a reduction round (`round_args`: store host, port, group id, the cell's rank in the
    round, the round's size). The core's rank (cell rank 0) sums the satellites' shards into its scratch (added to
    its gradients by `add_lane_sum` once the round checks out); a satellite's rank sends its gradients and zeroes
    them whatever the outcome. Raises GradientExchangeError."""
    host, port, group_id, rank, size = round_args
    if rank == 0:
        return member.reduce(host, port, group_id, 0, size, _core_scratch(trainer), lane)
    try:
        return member.reduce(host, port, group_id, rank, size, trainer.grad_buffer(), lane)
    finally:
        trainer.zero_grads()


def _reduce_lane_worker(trainer: MegatronTrainer, lane: int, round_args: tuple, device: str,
                        timeout_s: float) -> ReductionBytes:
    return reduce_lane(trainer, _lane_member(device, timeout_s), lane, round_args)


def add_lane_sum(trainer: MegatronTrainer) -> None:
    """Core: this rank's lane sum of the last round into its gradients."""
    trainer.add_flat_grads(_core_scratch(trainer))


def _ranks(trainer: MegatronTrainer) -> dict:
    from megatron.core import parallel_state

    return {"tensor": parallel_state.get_tensor_model_parallel_rank(),
            "pipeline": parallel_state.get_pipeline_model_parallel_rank(),
            "data": parallel_state.get_data_parallel_rank(),
            "expert": parallel_state.get_expert_model_parallel_rank(), "num_params": trainer.num_params}


COMMANDS = {
    "forward_backward": _forward_backward,
    "logprobs": _logprobs,
    "optimizer_step": lambda trainer, lr: _optimizer_step(trainer, _worker_served(), lr),
    "zero_grads": lambda trainer: trainer.zero_grads(),
    "grad_norm": lambda trainer: (trainer.reduce_grads(), trainer.grad_norm())[1],
    "load_shard": lambda trainer, shard, version: _load_shard(trainer, _worker_served(), shard, version),
    "hf_buckets": _hf_buckets,
    "save_part": save_part,
    "load_part": lambda trainer, checkpoint_path: _load_part(trainer, _worker_served(), checkpoint_path),
    "set_version": _set_version,
    "snapshot": _snapshot,
    "snapshot_buckets": _snapshot_buckets,
    "shard_source": _shard_source,
    "pull_shard": _pull_shard_worker,
    "reduce_lane": _reduce_lane_worker,
    "add_lane_sum": add_lane_sum,
    "drop_lanes": lambda trainer: _LANE["member"].drop() if "member" in _LANE else None,
}


class TrainerGroup:
    """World size > 1 of `TrainerConfig`: this process is rank 0 and drives the others (module docstring)."""

    def __init__(self, model_dir: str | Path, config: TrainerConfig, python: str = sys.executable) -> None:
        import torch.distributed as dist

        self.model_dir = Path(model_dir)
        self.config = config
        self.spec = ModelSpec.from_model_dir(self.model_dir)
        self.sizes = config.parallel
        self.world_size = self.sizes.world_size
        if self.world_size < 2:
            raise ConfigError("a TrainerGroup has at least two ranks; world size 1 is the in-process MegatronTrainer")
        config.check_parallel_fits(self.spec)
        self.device = trainer_device(config)  # checked here, before any worker starts
        if self.device.type == "cuda" and torch.cuda.device_count() < self.world_size:
            raise ConfigError(f"a trainer of {self.world_size} ranks needs {self.world_size} GPUs (one per rank); "
                              f"this machine has {torch.cuda.device_count()}")
        if dist.is_initialized():
            raise TrainerGroupError(
                f"this process already has a torch.distributed group (world size {dist.get_world_size()}): another "
                "trainer lives here, and a trainer group's rank 0 needs a process whose first group is the group's")
        self._lock = threading.Lock()
        self._served: ServedParams | None = None
        """Rank 0's shard as the cell serves it (`shard_sources`): the group's commands that change weights refresh it
        with the workers' own."""
        self._publications = 0
        self._broken = ""
        self._closed = False
        self._workdir = Path(tempfile.mkdtemp(prefix="gyre-trainer-group-"))
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._logs: list[Path] = []
        self.local: MegatronTrainer | None = None
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        deadline = time.monotonic() + config.group_start_timeout_s
        try:
            self._spawn(python, init_method)
            self._collect("start", deadline, expect="joining")
            parallel.init_parallel(0, self.world_size, init_method, self.sizes, self.device.type,
                                   timeout_s=config.group_start_timeout_s)
            self.local = MegatronTrainer(self.model_dir, config)
            self.ranks = [_ranks(self.local)] + self._collect("start", deadline)
            """Per global rank: its tensor, pipeline and data-parallel rank and the size of its shard."""
            if not self.local.is_publisher:
                raise TrainerGroupError("rank 0 is not the publishing rank of megatron's layout")
        except BaseException as error:
            reason = self._dead_worker_report("start", wait_s=_EXIT_GRACE_S)
            self._shutdown(kill=True)
            if reason:
                raise TrainerGroupError(reason) from error
            raise
        log.info("trainer_group_ready", world_size=self.world_size, tensor=self.sizes.tensor,
                 pipeline=self.sizes.pipeline, data=self.sizes.data, expert=self.sizes.expert, device=self.device.type,
                 shard_params=[r["num_params"] for r in self.ranks])

    # ---- processes ------------------------------------------------------------------------------------------

    def _spawn(self, python: str, init_method: str) -> None:
        env = dict(os.environ)
        if self.config.num_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.config.num_threads)
        for rank in range(1, self.world_size):
            parent, child = socket.socketpair()
            path = self._workdir / f"rank{rank}.log"
            with open(path, "wb") as output:
                proc = subprocess.Popen([python, "-m", "gyre.engines.trainer_group", str(child.fileno())],
                                        pass_fds=(child.fileno(),), stdout=output, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env)
            child.close()
            conn = Connection(parent.detach())
            self._procs.append(proc)
            self._conns.append(conn)
            self._logs.append(path)
            _send(conn, ("init", rank, self.world_size, init_method, self.sizes, self.device.type,
                       str(self.model_dir), self.config))

    def _rank_report(self, rank: int, during: str, why: str) -> str:
        proc = self._procs[rank - 1]
        code = proc.poll()
        state = f"exited with code {code}" if code is not None else f"is alive (pid {proc.pid}) but {why}"
        return (f"trainer group rank {rank} of {self.world_size} {state} during {during!r}; its output ends with:\n"
                f"{_tail(self._logs[rank - 1])}")

    def _dead_worker_report(self, during: str, wait_s: float = 0.0) -> str:
        """A report on the first worker that has exited ("" if all live), waiting up to `wait_s` for one to."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self._procs, start=1):
                if proc.poll() is not None:
                    return self._rank_report(rank, during, "")
            if time.monotonic() >= deadline:
                return ""
            time.sleep(_POLL_S)

    def _fail(self, message: str) -> TrainerGroupError:
        self._broken = message
        log.error("trainer_group_failed", error=message)
        return TrainerGroupError(message)

    def _receive(self, rank: int, during: str, deadline: float) -> Any:
        conn, proc = self._conns[rank - 1], self._procs[rank - 1]
        while True:
            try:
                if conn.poll(_POLL_S):
                    return _recv(conn)
            except (EOFError, OSError):
                try:
                    proc.wait(timeout=_EXIT_GRACE_S)  # a closed pipe is a dying worker: let its exit code show
                except subprocess.TimeoutExpired:
                    pass
                raise self._fail(self._rank_report(rank, during, "closed its command pipe")) from None
            if proc.poll() is not None:
                raise self._fail(self._rank_report(rank, during, ""))
            if time.monotonic() > deadline:
                raise self._fail(self._rank_report(rank, during, "did not answer in time"))

    def _collect(self, during: str, deadline: float, expect: str = "ok") -> list[Any]:
        """Every worker's reply to the last command, in rank order. A worker's error (its own, when rank 0's part
        succeeded) is raised as TrainerGroupError with its traceback."""
        results = []
        errors = []
        for rank in range(1, self.world_size):
            reply = self._receive(rank, during, deadline)
            if reply[0] == expect:
                results.append(reply[1] if len(reply) > 1 else None)
            elif reply[0] == "error":
                errors.append(f"rank {rank}: {reply[1]}: {reply[2]}\n{reply[3]}")
                results.append(None)
            else:
                raise self._fail(f"trainer group rank {rank} answered {reply[0]!r} to {during!r}")
        if errors:
            raise TrainerGroupCommandError(f"trainer group command {during!r} failed on " + "\n".join(errors))
        return results

    def _run(self, command: str, worker_args: Sequence[tuple], local: Any) -> tuple[Any, list[Any]]:
        """Send `command` to every worker (rank r gets worker_args[r - 1]), run `local()` here, collect."""
        with self._lock:
            return self._run_locked(command, worker_args, local)

    def _check_usable(self) -> None:
        if self._closed:
            raise TrainerGroupError("the trainer group is closed")
        if self._broken:
            raise TrainerGroupError(f"the trainer group failed earlier: {self._broken}")

    def _send_all(self, command: str, worker_args: Sequence[tuple]) -> float:
        self._check_usable()
        for rank, args in enumerate(worker_args, start=1):
            try:
                _send(self._conns[rank - 1], (command, args))
            except (OSError, EOFError):
                raise self._fail(self._rank_report(rank, command, "closed its command pipe")) from None
        return time.monotonic() + self.config.group_timeout_s

    def _run_locked(self, command: str, worker_args: Sequence[tuple], local: Any) -> tuple[Any, list[Any]]:
        deadline = self._send_all(command, worker_args)
        try:
            mine = local()
        except BaseException as error:
            dead = self._dead_worker_report(command, wait_s=_EXIT_GRACE_S)
            if dead:
                raise self._fail(dead) from error
            # The same error on every rank (bad input the checks here did not catch): their replies say so too.
            try:
                self._collect(command, deadline)
            except TrainerGroupCommandError:
                pass
            raise
        return mine, self._collect(command, deadline)

    def _same_for_all(self, *args: Any) -> list[tuple]:
        return [args] * (self.world_size - 1)

    def _per_replica(self, shares: Sequence[Any]) -> list[tuple]:
        return [(shares[self.ranks[rank]["data"]],) for rank in range(1, self.world_size)]

    # ---- the trainer's surface --------------------------------------------------------------------------------

    @property
    def _trainer(self) -> MegatronTrainer:
        assert self.local is not None
        return self.local

    @property
    def version(self) -> int:
        return self._trainer.version

    @version.setter
    def version(self, value: int) -> None:
        self._run("set_version", self._same_for_all(value), lambda: _set_version(self._trainer, value))

    @property
    def num_params(self) -> int:
        """Elements of rank 0's shard (its flat buffers)."""
        return self._trainer.num_params

    @property
    def is_publisher(self) -> bool:
        return True

    @property
    def has_average(self) -> bool:
        return self._trainer.has_average

    def param_layout(self):
        """Rank 0's shard layout (megatron names, local to its stage)."""
        return self._trainer.param_layout()

    def param_buffer(self) -> torch.Tensor:
        """Rank 0's live flat shard. Not the whole model: a peer that pulls whole flat weights gets a layout
        error (weight_pull checks sizes)."""
        return self._trainer.param_buffer()

    def flat_params(self) -> torch.Tensor:
        return self._trainer.flat_params()

    def scheduled_lr(self) -> float:
        return self._trainer.scheduled_lr()

    def _check_batch(self, input_ids, lengths, temperatures) -> None:
        ids, lens = self._trainer._check_batch(input_ids, lengths)
        self._trainer._check_temperatures(temperatures, ids)

    def forward_backward(self, input_ids: torch.Tensor, lengths: torch.Tensor, loss_fn: LossFn,
                         temperatures: torch.Tensor | None = None) -> dict:
        """MegatronTrainer.forward_backward over the group. `loss_fn` must pickle (a module-level function or a
        functools.partial of one): every rank computes the loss of its stage's output. With data-parallel replicas,
        replica 0 computes the whole batch (`forward_backward_shares` spreads rows instead)."""
        shares: list = [None] * self.sizes.data
        shares[0] = (input_ids, lengths, loss_fn, temperatures)
        out = self.forward_backward_shares(shares)[0]
        assert out is not None
        return out

    def forward_backward_shares(self, shares: Sequence[tuple | None]) -> list[dict | None]:
        """One (input_ids, lengths, loss_fn, temperatures) or None per data-parallel replica: each replica
        accumulates the gradients of its share (they are summed over the replicas at the optimizer step). Returns
        each replica's metrics (None for an empty share). Losses that are sums over rows (Gyre's) make the replicas'
        sum the whole batch's."""
        if len(shares) != self.sizes.data:
            raise TrainerError(f"{len(shares)} shares for {self.sizes.data} data-parallel replicas")
        for share in shares:
            if share is not None:
                self._check_batch(share[0], share[1], share[3] if len(share) > 3 else None)
        mine, others = self._run("forward_backward", self._per_replica(shares),
                                 lambda: _forward_backward(self._trainer, shares[0]))
        results: list[dict | None] = [None] * self.sizes.data
        results[0] = mine
        for rank in range(1, self.world_size):
            replica = self.ranks[rank]["data"]
            if results[replica] is None and others[rank - 1] is not None:
                results[replica] = others[rank - 1]
        return results

    def logprobs(self, input_ids: torch.Tensor, lengths: torch.Tensor,
                 temperatures: torch.Tensor | None = None) -> torch.Tensor:
        self._check_batch(input_ids, lengths, temperatures)
        batch = (input_ids, lengths, temperatures)
        shares = [batch] + [None] * (self.sizes.data - 1)
        mine, _ = self._run("logprobs", self._per_replica(shares), lambda: _logprobs(self._trainer, batch))
        return mine

    def zero_grads(self) -> None:
        self._run("zero_grads", self._same_for_all(), self._trainer.zero_grads)

    def grad_norm(self) -> float:
        """The global norm of the gradients summed so far (reduced over the replicas first)."""
        mine, _ = self._run("grad_norm", self._same_for_all(), lambda: COMMANDS["grad_norm"](self._trainer))
        return mine

    def optimizer_step(self, lr: float | None = None) -> dict:
        """AdamW on every shard; each rank's served copy (if it serves one) takes the new weights before this
        returns."""
        mine, _ = self._run("optimizer_step", self._same_for_all(lr),
                            lambda: _optimizer_step(self._trainer, self._served, lr))
        return mine

    def grad_buffer(self) -> torch.Tensor:
        raise TrainerError("a trainer group has no whole-model gradient buffer: its gradients are reduced lane by "
                           "lane, each rank's shard with the same rank of the other cells (reduce_lanes)")

    def add_flat_grads(self, flat: torch.Tensor, scale: float = 1.0) -> None:
        raise TrainerError("a trainer group takes no whole-model flat gradients: a round's sum lands on each rank "
                           "as its shard (reduce_lanes, then add_lane_sums)")

    @property
    def layout(self) -> tuple[int, int, int]:
        """(tensor, pipeline, data) sizes: the training layout every cell of a round shares."""
        return (self.sizes.tensor, self.sizes.pipeline, self.sizes.data)

    @property
    def lane_numels(self) -> tuple[int, ...]:
        """Elements of each global rank's flat gradient buffer (lane g of a round reduces rank g's)."""
        return tuple(int(rank["num_params"]) for rank in self.ranks)

    def shard_sources(self, agent: Any, served: ServedParams) -> list[tuple[str, int, int]]:
        """Every rank's parameter shard as a pull source (peer, address, bytes), global rank order: rank 0's as
        `served` serves it (through `agent`, the cell's), each worker's through its own agent (started now with
        `agent`'s TransferConfig) and served the same way (`served.how`: in place, or a host copy that the group's
        steps and loads refresh). Peers pull rank g's shard into their rank g (`pull_shards`)."""
        if served.params is not self._trainer.param_buffer():
            raise TrainerError("the served parameters are not this group's rank 0 shard")
        _, others = self._run("shard_source", self._same_for_all(agent.config, served.how), lambda: None)
        self._served = served
        return [served.source()] + others

    def pull_shards(self, agent: Any, shards: Sequence[tuple[str, int, int]]) -> int:
        """Each rank pulls its shard of another cell's weights (`shards`: that cell's `shard_sources`, same layout)
        into its parameters, all at once; rank 0 through `agent`. Returns the bytes moved. Raises TrainerError for a
        shard of another size, TrainerGroupCommandError when a worker's pull failed."""
        if len(shards) != self.world_size:
            raise TrainerError(f"{len(shards)} weight shards for a trainer of {self.world_size} ranks")
        def pull_mine() -> int:
            moved = pull_shard(self._trainer, agent, tuple(shards[0]))
            _refresh(self._served, self._trainer)
            return moved

        mine, others = self._run("pull_shard", [(tuple(shard),) for shard in shards[1:]], pull_mine)
        return mine + sum(others)

    def reduce_lanes(self, member: ReductionMember, host: str, port: int, group_id: int, rank: int,
                     size: int) -> list[ReductionBytes]:
        """This cell's side of a reduction round, every lane at once: global rank g reduces its shard's gradients
        over lane g's group with rank g of the round's other cells (`rank` is this cell's rank in the round: 0 for
        the core, whose ranks receive the sums into their scratch; a satellite's ranks send theirs and zero them).
        Rank 0 uses `member` (the cell's: the core's holds the rendezvous store), each worker its own. Returns the
        bytes each lane moved (global rank order). Raises GradientExchangeError when a lane fails (every lane's
        group is then dropped); TrainerGroupError when a worker died."""
        round_args = (host, port, group_id, rank, size)
        args = [(lane, round_args, member.device, member.timeout_s) for lane in range(1, self.world_size)]
        try:
            mine, others = self._run("reduce_lane", args, lambda: reduce_lane(self._trainer, member, 0, round_args))
        except GradientExchangeError:
            self.drop_lanes(member)
            raise
        except TrainerGroupCommandError as error:  # another lane failed: its peers saw the same round fail
            self.drop_lanes(member)
            raise GradientExchangeError(f"a lane of round group {group_id} failed: {error}") from error
        return [mine] + others

    def add_lane_sums(self) -> None:
        """Core: the last round's sum into the step's gradients, each rank its lane's."""
        self._run("add_lane_sum", self._same_for_all(), lambda: add_lane_sum(self._trainer))

    def drop_lanes(self, member: ReductionMember) -> None:
        """Forget every lane's round group (after a failure: the next round forms fresh ones)."""
        member.drop()
        try:
            self._run("drop_lanes", self._same_for_all(), lambda: None)
        except TrainerGroupCommandError:
            pass

    def load_flat_params(self, flat: torch.Tensor, version: int | None = None) -> None:
        raise TrainerError("a trainer group loads weights by name (load_hf_state_dict), not as a flat buffer")

    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Load HF-named weights: rank 0 cuts them and sends each rank only its shard."""
        from gyre.engines.weight_convert import hf_to_megatron

        full = hf_to_megatron(state, self.spec)
        shards = {}
        for rank in range(self.world_size):
            key = _shard_key(self.ranks[rank])
            if key not in shards:
                shards[key] = parallel.shard_state(full, self.spec, key[0], self.sizes.tensor, key[1],
                                                   self.sizes.pipeline, key[2], self.sizes.expert)
        del full
        args = [(shards[_shard_key(self.ranks[r])], version) for r in range(1, self.world_size)]
        self._run("load_shard", args, lambda: _load_shard(self._trainer, self._served, shards[(0, 0, 0)], version))

    def load_model_dir(self, model_dir: str | Path, version: int | None = None) -> None:
        self.load_hf_state_dict(load_hf_state_dict(Path(model_dir)), version)

    def iter_hf_buckets(self, bucket_bytes: int = 256 << 20, averaged: bool = False):
        """The weights under HF names, one bucket at a time, gathered from every rank's shard as the caller iterates
        (parallel.gather_buckets): at most one bucket of the model is ever whole on rank 0, and none elsewhere. The
        group stays locked (no step changes the weights) until the iteration ends; a caller that stops early still
        lets the workers finish theirs (the rest is gathered and dropped)."""
        with self._lock:
            yield from self._gather_locked("hf_buckets", (bucket_bytes, averaged),
                                           self._trainer.iter_hf_buckets(bucket_bytes, averaged))

    def publication(self, bucket_bytes: int = 256 << 20, averaged: bool = False) -> HFBuckets:
        """This version's weights for publishing: every rank copies its shard now (call it under the lock that
        keeps steps out, so the version is exact), and each pass over the returned HFBuckets gathers that copy
        bucket by bucket (`iter_hf_buckets`' bound, plus one shard-sized copy per rank). A later publication
        replaces the copy; a pass over an older one then raises TrainerError."""
        with self._lock:
            self._publications += 1
            snapshot_id = self._publications
            version = self.version
            self._run_locked("snapshot", self._same_for_all(snapshot_id, averaged),
                             lambda: _snapshot(self._trainer, snapshot_id, averaged))
        plan = parallel.bucket_plan(self.spec, bucket_bytes)

        def buckets():
            with self._lock:
                flat = _snapshot_flat(snapshot_id)
                yield from self._gather_locked("snapshot_buckets", (snapshot_id, bucket_bytes),
                                               self._trainer.iter_hf_buckets(bucket_bytes, flat=flat))

        total = sum(parallel._full_numel(self.spec, name) for bucket in plan for name in bucket) * 4
        return HFBuckets(buckets, version, len(plan), total)

    def _gather_locked(self, command: str, args: tuple, buckets):
        """Rank 0's side of a bucket gather the workers run as `command`: yields rank 0's buckets; whatever the
        caller does, the rest is gathered too (the workers gather every bucket) and the replies are collected."""
        deadline = self._send_all(command, self._same_for_all(*args))
        try:
            for bucket in buckets:
                yield bucket
        finally:  # also when the caller stops early: the workers gather every bucket, so must this side
            try:
                for _ in buckets:
                    pass
                self._collect(command, deadline)
            except TrainerGroupError:
                raise
            except Exception as error:
                dead = self._dead_worker_report(command, wait_s=_EXIT_GRACE_S)
                raise self._fail(dead or f"{command} failed on rank 0: {error}") from error

    def hf_state_dict(self, averaged: bool = False) -> dict[str, torch.Tensor]:
        """The whole model under HF names on rank 0 (from the buckets; what `save_hf` and an in-process engine,
        which holds the whole model anyway, need). Publishing to engine servers takes `iter_hf_buckets` instead."""
        out: dict[str, torch.Tensor] = {}
        for bucket in self.iter_hf_buckets(averaged=averaged):
            out.update(bucket)
        return out

    def save_hf(self, model_dir: str | Path, averaged: bool = False) -> Path:
        return save_model_dir(self.model_dir, model_dir, self.hf_state_dict(averaged))

    def checkpoint_state(self) -> dict:
        raise TrainerError("a trainer group's checkpoint is sharded: save_sharded_checkpoint(folder)")

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        raise TrainerError("a trainer group's checkpoint is sharded: load_sharded_checkpoint(path)")

    def save_sharded_checkpoint(self, folder: str | Path) -> tuple[list[Any], str]:
        """Every rank writes its shard's state into `folder` (one file per tensor x pipeline rank). Returns the
        PartRecords (rank order, one per file) and a digest over every shard's state digest."""
        mine, others = self._run("save_part", self._same_for_all(str(folder)),
                                 lambda: save_part(self._trainer, str(folder)))
        replies = [mine] + others
        records = [record for record, _ in replies if record is not None]
        return records, _group_digest(self.ranks, [digest for _, digest in replies])

    def load_sharded_checkpoint(self, checkpoint_path: str | Path) -> str:
        """Every rank restores its shard from the committed checkpoint; returns the digest `save_sharded_checkpoint`
        gave when the state was saved."""
        mine, others = self._run("load_part", self._same_for_all(str(checkpoint_path)),
                                 lambda: _load_part(self._trainer, self._served, str(checkpoint_path)))
        return _group_digest(self.ranks, [mine] + others)

    # ---- closing ----------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers (a shutdown command, then a kill after a grace period) and leave the process group."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._shutdown(kill=bool(self._broken))
            if not self._broken:  # a failed group's worker logs stay for whoever reads its error
                shutil.rmtree(self._workdir, ignore_errors=True)

    def _shutdown(self, kill: bool) -> None:
        for conn in self._conns:
            try:
                if not kill:
                    _send(conn, ("shutdown", ()))
            except (OSError, EOFError):
                pass
        deadline = time.monotonic() + (0.0 if kill else 10.0)
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()) or 0.01)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for conn in self._conns:
            conn.close()
        self._conns.clear()
        self.local = None
        try:
            import torch.distributed as dist
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as error:  # a broken group may not leave cleanly; the process keeps nothing of it
            log.warning("trainer_group_leave_failed", error=str(error))

    def __del__(self) -> None:
        for proc in getattr(self, "_procs", []):
            if proc.poll() is None:
                proc.kill()


def _shard_key(rank: Mapping[str, int]) -> tuple[int, int, int]:
    """A rank's shard: its (tensor, pipeline, expert) ranks (`parallel.shard_rank`)."""
    return (rank["tensor"], rank["pipeline"], rank["expert"])


def _group_digest(ranks: Sequence[Mapping[str, int]], digests: Sequence[str]) -> str:
    """One digest over the shards' digests, each (tensor, pipeline, expert) shard once, in shard order."""
    by_shard = {}
    for rank, digest in zip(ranks, digests):
        by_shard.setdefault(_shard_key(rank), digest)
    combined = hashlib.sha256()
    for key in sorted(by_shard):
        # Without expert parallelism the same text as before experts were split: digests stay comparable.
        combined.update((f"tp{key[0]}.pp{key[1]}" + (f".ep{key[2]}" if key[2] else "") + f"={by_shard[key]};")
                        .encode())
    return combined.hexdigest()


def _worker_main(fd: int) -> None:
    conn = Connection(fd)
    try:
        _, rank, world_size, init_method, sizes, device, model_dir, config = _recv(conn)
    except EOFError:
        return
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    _send(conn, ("joining",))
    parallel.init_parallel(rank, world_size, init_method, sizes, device, timeout_s=config.group_timeout_s)
    trainer = MegatronTrainer(model_dir, config)
    _send(conn, ("ok", _ranks(trainer)))
    while True:
        try:
            command, args = _recv(conn)
        except (EOFError, OSError):  # rank 0 is gone: nothing to serve
            return
        if command == "shutdown":
            _send(conn, ("ok",))
            return
        try:
            result = COMMANDS[command](trainer, *args)
        except Exception as error:
            _send(conn, ("error", type(error).__name__, str(error), traceback.format_exc(limit=8)))
            continue
        _send(conn, ("ok", result))


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]))
