"""An emulated inference engine: the sessions a rollout cell holds, advanced event by event in its own time.

Why an internal event loop and not one message per model call: the TerminalBench-like preset makes ~800k calls per
policy, and a simulate run compares ~16 policies; a message per call would cost minutes each. The engine keeps the
calls inside the cell (as a real engine keeps its batch), and the cell actor advances it to the runtime clock on
every tick; only sessions entering and leaving the cell are messages.

The model. A session alternates: prefill (the new context of a call), decode (its output tokens), tool time (the
agent's tool, then the next call). Prefill and decode share the engine by iterations, as SGLang's chunked prefill
does: an iteration decodes one token for each running sequence and prefills at most one chunk; its time is
`CellModel.mixed_iteration_s`. Sequences in one phase share it equally (processor sharing), so a phase's finishing
order is kept in a heap keyed by "attained service" and rates change without rescheduling anything. Decode admits
a sequence only while the KV of running sequences fits (`kv_capacity_tokens`); the rest wait (waiting_requests).
Prefix cache: while the contexts of every session held fit the KV pool a call prefills only its new tokens; beyond
it, the expected share of evicted prefix (1 - capacity / held) is prefilled again. Sessions moved in without their
KV (re-placed after their cell freed it) prefill their whole context once.
"""

from __future__ import annotations

import heapq
from typing import Iterable

import attrs

from gyre.simulate.hardware import CellModel
from gyre.simulate.workloads import ExecutionPlan

__all__ = ["Session", "Engine", "SETUP", "PREFILL", "DECODE", "TOOL", "DONE"]

SETUP, PREFILL, DECODE, TOOL, DONE = "setup", "prefill", "decode", "tool", "done"


@attrs.define(eq=False)
class Session:
    """One execution's place in its rollout: mutable, owned by one engine (or the agents) at a time."""

    plan: ExecutionPlan
    group_id: str
    phase: str = SETUP
    turn: int = 0
    """Index of the current (or next) call."""
    context_tokens: int = 0
    """Tokens of the context the session holds (prompt, outputs and observations so far)."""
    phase_end_s: float = 0.0
    """Setup or tool phases: when they end (absolute runtime time, so an unplaced session's tool keeps running)."""
    remaining_tokens: float = 0.0
    """Prefill or decode phases: tokens left."""
    decode_after_prefill: float = 0.0
    """Output tokens still to decode once a re-prefill (after a move without KV) is done."""
    kv_cached: bool = False
    """The holding engine has this session's prefix."""
    min_weight_version: int = -1
    max_weight_version: int = -1
    output_tokens_done: int = 0
    prefill_tokens_done: float = 0.0
    finished_s: float = 0.0


class Engine:
    """Sessions on one rollout cell; `advance(to_s)` runs them up to `to_s` and returns those that finished."""

    def __init__(self, model: CellModel, now_s: float = 0.0) -> None:
        self.model = model
        self.now_s = now_s
        self.kv_capacity = model.kv_capacity_tokens
        self.sessions: set[Session] = set()
        self._timers: list[tuple[float, int, Session]] = []  # setup and tool ends
        self._prefill: list[tuple[float, int, Session]] = []  # by service target
        self._decode: list[tuple[float, int, Session]] = []
        self._waiting: list[Session] = []  # prefilled, waiting for KV room to decode
        self._prefill_service = 0.0
        self._decode_service = 0.0
        self._prefill_target_sum = 0.0
        self._decode_context = 0.0
        self._held_context = 0.0
        self._seq = 0
        self.paused_until_s = now_s
        self.weight_version = 0
        self.busy_s = 0.0
        self.output_tokens = 0
        self.prefill_tokens = 0.0
        self.calls = 0
        # Where the engine's time went (simulate/accounting.py reads these; nothing here decides anything by them).
        # Every second advanced is in exactly one of decode_s (iteration time less the prefill chunk mixed into it),
        # prefill_s (the chunk's share; the whole iteration when nothing decodes), paused_s (a weight update),
        # tools_s (sessions held, every one in setup, a tool call or scoring) and empty_s (no session); busy_s is
        # decode_s + prefill_s. While something decodes (decoding_s), the integrals of the sequences decoding and of
        # the KV tokens they hold give the mean batch and KV occupancy. Prefill tokens started, and of them evicted
        # prefixes prefilled again and whole contexts of sessions that moved here without their KV.
        self.decode_s = self.prefill_s = self.paused_s = self.tools_s = self.empty_s = 0.0
        self.decoding_s = self.decoding_sequence_s = self.decoding_kv_token_s = 0.0
        self.prefill_started_tokens = self.evicted_prefill_tokens = self.moved_prefill_tokens = 0.0
        self._prefill_rate = model.prefill_tokens_per_s
        # CellModel.mixed_iteration_s, unfolded into constants: the event loop evaluates it at every event, and the
        # attrs properties behind it (bandwidth, prefill rate) were a third of a run's time.
        # Other models (simulate/calibrated.py) are asked through mixed_iteration_s itself.
        self._unfolded = isinstance(model, CellModel)
        if not self._unfolded:
            return
        bandwidth = model.gpus * model.gpu.hbm_bytes_per_s * model.decode_bandwidth_fraction
        self._bandwidth = bandwidth
        self._weight_bytes = model.model.weight_bytes
        self._kv_bytes_per_token = model.model.kv_bytes_per_token
        self._flops_per_sequence = 2 * model.model.active_params
        self._decode_flops = model.gpus * model.gpu.bf16_flops * 0.5
        self._overhead_s = model.iteration_overhead_s
        self._prefill_tokens_per_s = model.prefill_tokens_per_s
        self._chunk_tokens = model.chunked_prefill_tokens

    # ---- what the cell reports ------------------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self._decode) + len(self._prefill)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def held_context_tokens(self) -> float:
        return self._held_context

    # ---- sessions in and out --------------------------------------------------------------------------------------
    def admit(self, sessions: Iterable[Session]) -> None:
        for session in sessions:
            self.sessions.add(session)
            self._held_context += session.context_tokens
            if session.phase in (SETUP, TOOL):
                self._push_timer(max(session.phase_end_s, self.now_s), session)
            elif session.phase in (PREFILL, DECODE):
                # A call in flight moved here: without its KV it prefills its context again, then decodes the rest.
                remaining_decode = session.remaining_tokens if session.phase == DECODE else session.decode_after_prefill
                if session.phase == PREFILL and session.kv_cached:
                    self._start_prefill(session, session.remaining_tokens, session.decode_after_prefill)
                else:
                    tokens = session.context_tokens if not session.kv_cached else 0
                    self.moved_prefill_tokens += tokens
                    self._start_prefill(session, max(1, tokens), remaining_decode)
            session.kv_cached = True

    def take_all(self, keep_kv: bool) -> list[Session]:
        """Every session out (the cell leaves rollout), their state frozen at `now_s`; `keep_kv`: their prefixes
        move with them (a migration), else the next holder prefills them again."""
        for target, _, session in self._prefill:
            session.remaining_tokens = max(0.0, target - self._prefill_service)
        for target, _, session in self._decode:
            remaining = max(0.0, target - self._decode_service)
            produced = round(session.remaining_tokens - remaining)  # what it decoded here is its output for good
            session.output_tokens_done += produced
            session.context_tokens += produced
            self.output_tokens += produced
            session.remaining_tokens = session.remaining_tokens - produced
        out = sorted(self.sessions, key=lambda s: s.plan.execution_id)
        waiting = set(self._waiting)
        for session in out:
            session.kv_cached = keep_kv
            if session in waiting:
                session.phase = DECODE  # waiting to decode: it keeps its remaining output
        self.sessions = set()
        self._timers, self._prefill, self._decode, self._waiting = [], [], [], []
        self._prefill_target_sum = self._decode_context = self._held_context = 0.0
        return out

    def take_idle(self, count: int) -> list[Session]:
        """Up to `count` sessions that are between calls (setup, a tool call or scoring), those with the longest
        wait left first (their KV has the most time to move before they call again), out of the engine with their
        KV (a migration); the sessions computing stay."""
        if count <= 0:
            return []
        idle = sorted((entry for entry in self._timers), key=lambda e: (-e[0], e[1]))[:count]
        if not idle:
            return []
        chosen = {id(entry[2]) for entry in idle}
        self._timers = [entry for entry in self._timers if id(entry[2]) not in chosen]
        heapq.heapify(self._timers)
        out = [entry[2] for entry in idle]
        for session in out:
            self.sessions.discard(session)
            self._held_context -= session.context_tokens
            session.kv_cached = True
        return out

    def pause(self, until_s: float) -> None:
        """No iteration runs before `until_s` (a weight update)."""
        self.paused_until_s = max(self.paused_until_s, until_s)

    # ---- the event loop -------------------------------------------------------------------------------------------
    def advance(self, to_s: float) -> list[Session]:
        """Run every session up to `to_s`; the finished ones (reward included) are returned and forgotten."""
        finished: list[Session] = []
        model, unfolded = self.model, self._unfolded
        if unfolded:
            chunk_tokens, bandwidth, overhead_s = self._chunk_tokens, self._bandwidth, self._overhead_s
            weight_bytes, kv_bytes = self._weight_bytes, self._kv_bytes_per_token
            flops_per_sequence, decode_flops = self._flops_per_sequence, self._decode_flops
            prefill_rate = self._prefill_tokens_per_s
        else:
            chunk_tokens = model.chunked_prefill_tokens
        # The loop runs once per event (a phase ending) of every session held: the hottest code of a simulation. The
        # services, clock and counters live in locals and go back to the engine only where the methods that move
        # sessions read them (_pop_due), and at the end; every float operation is the one it always was, in the same
        # order, so the results are bit-identical to the plain version.
        timers, prefill, decode = self._timers, self._prefill, self._decode
        paused_until_s = self.paused_until_s  # nothing in here pauses the engine
        now = self.now_s
        prefill_service, decode_service = self._prefill_service, self._decode_service
        busy_s, prefill_tokens = self.busy_s, self.prefill_tokens
        prefill_rate_any = self._prefill_rate
        decode_s = prefill_s = paused_s = tools_s = empty_s = 0.0
        decoding_s = decoding_sequence_s = decoding_kv_token_s = 0.0
        while True:
            paused = now < paused_until_s
            n_p, n_d = len(prefill), len(decode)
            rate_p = rate_d = 0.0
            prefill_share = 0.0
            next_s = to_s
            if paused:
                next_s = min(next_s, paused_until_s)
            elif n_p or n_d:
                pending = self._prefill_target_sum - n_p * prefill_service
                # = model.mixed_iteration_s(n_d, self._decode_context, pending if n_p else 0.0), unfolded
                chunk = (pending if pending < chunk_tokens else chunk_tokens) if n_p else 0.0
                if not unfolded:
                    iteration_s = model.mixed_iteration_s(n_d, self._decode_context, pending if n_p else 0.0)
                elif n_d:
                    memory_s = (weight_bytes + self._decode_context * kv_bytes) / bandwidth
                    compute_s = n_d * flops_per_sequence / decode_flops
                    iteration_s = (memory_s if memory_s > compute_s else compute_s) + overhead_s
                    iteration_s += chunk / prefill_rate
                else:
                    iteration_s = overhead_s + chunk / prefill_rate
                prefill_share = chunk / prefill_rate_any / iteration_s if n_d else 1.0
                if n_p:
                    rate_p = chunk / iteration_s / n_p
                    if rate_p > 0:
                        candidate = now + (prefill[0][0] - prefill_service) / rate_p
                        if candidate < next_s:
                            next_s = candidate
                if n_d:
                    rate_d = 1.0 / iteration_s
                    candidate = now + (decode[0][0] - decode_service) / rate_d
                    if candidate < next_s:
                        next_s = candidate
            if timers and timers[0][0] < next_s:
                next_s = timers[0][0]
            if next_s < now:
                next_s = now
            step = next_s - now
            if n_p or n_d:
                if not paused:
                    busy_s += step
                prefill_service += rate_p * step
                decode_service += rate_d * step
                prefill_tokens += rate_p * step * n_p
            if paused:
                paused_s += step
            elif n_p or n_d:
                prefill_s += step * prefill_share
                decode_s += step * (1.0 - prefill_share)
                if n_d:
                    decoding_s += step
                    decoding_sequence_s += step * n_d
                    decoding_kv_token_s += step * self._decode_context
            elif self.sessions:
                tools_s += step
            else:
                empty_s += step
            now = next_s
            # _pop_due moves something exactly when one of these heads is due (it only pushes what it popped).
            if ((timers and timers[0][0] <= now + 1e-9) or (prefill and prefill[0][0] <= prefill_service + 1e-6)
                    or (decode and decode[0][0] <= decode_service + 1e-6)):
                self.now_s, self._prefill_service, self._decode_service = now, prefill_service, decode_service
                self._pop_due(finished)
            elif next_s >= to_s:
                break
        self.now_s, self._prefill_service, self._decode_service = now, prefill_service, decode_service
        self.busy_s, self.prefill_tokens = busy_s, prefill_tokens
        self.decode_s += decode_s
        self.prefill_s += prefill_s
        self.paused_s += paused_s
        self.tools_s += tools_s
        self.empty_s += empty_s
        self.decoding_s += decoding_s
        self.decoding_sequence_s += decoding_sequence_s
        self.decoding_kv_token_s += decoding_kv_token_s
        return finished

    def _pop_due(self, finished: list[Session]) -> bool:
        timers, prefill, decode, heappop = self._timers, self._prefill, self._decode, heapq.heappop
        due_s = self.now_s + 1e-9  # the clock and services do not move in here
        moved = False
        while timers and timers[0][0] <= due_s:
            _, _, session = heappop(timers)
            moved = True
            self._timer_done(session, finished)
        due_prefill = self._prefill_service + 1e-6
        while prefill and prefill[0][0] <= due_prefill:
            target, _, session = heappop(prefill)
            moved = True
            self._prefill_target_sum -= target
            session.prefill_tokens_done += session.remaining_tokens
            self._start_decode(session, session.decode_after_prefill)
        due_decode = self._decode_service + 1e-6
        while decode and decode[0][0] <= due_decode:
            _, _, session = heappop(decode)
            moved = True
            self._decode_done(session)
        return moved

    def _timer_done(self, session: Session, finished: list[Session]) -> None:
        plan = session.plan
        if session.phase == SETUP:
            session.context_tokens = plan.prompt_tokens
            self._held_context += plan.prompt_tokens
            self._start_prefill(session, plan.prompt_tokens, plan.output_tokens[0])
            return
        # TOOL: the observation joins the context and the next call starts, or the execution is over.
        session.turn += 1
        if session.turn >= len(plan.output_tokens):  # plan.turns, without the property call
            session.phase = DONE
            session.finished_s = self.now_s
            self.sessions.discard(session)
            self._held_context -= session.context_tokens
            finished.append(session)
            return
        observation = plan.observation_tokens[session.turn - 1]
        evicted = 0.0
        if self._held_context > self.kv_capacity:
            evicted = session.context_tokens * (1.0 - self.kv_capacity / self._held_context)
        self.evicted_prefill_tokens += evicted
        session.context_tokens += observation
        self._held_context += observation
        self._start_prefill(session, observation + evicted, plan.output_tokens[session.turn])

    def _start_prefill(self, session: Session, tokens: float, then_decode: float) -> None:
        session.phase = PREFILL
        session.remaining_tokens = tokens
        session.decode_after_prefill = then_decode
        self.prefill_started_tokens += tokens
        target = self._prefill_service + tokens
        self._prefill_target_sum += target
        self._seq += 1
        heapq.heappush(self._prefill, (target, self._seq, session))
        self.calls += 1

    def _start_decode(self, session: Session, tokens: float) -> None:
        session.phase = DECODE
        session.remaining_tokens = tokens
        version = self.weight_version
        if session.min_weight_version < 0 or version < session.min_weight_version:
            session.min_weight_version = version
        session.max_weight_version = max(session.max_weight_version, version)
        if self._decode and (self._decode_context + session.context_tokens > self.kv_capacity
                             or len(self._decode) >= self.model.max_running_requests):
            self._waiting.append(session)
            return
        self._push_decode(session)

    def _push_decode(self, session: Session) -> None:
        self._decode_context += session.context_tokens
        self._seq += 1
        heapq.heappush(self._decode, (self._decode_service + session.remaining_tokens, self._seq, session))

    def _decode_done(self, session: Session) -> None:
        self._decode_context -= session.context_tokens
        produced = round(session.remaining_tokens)
        session.output_tokens_done += produced
        self.output_tokens += produced
        session.context_tokens += produced
        self._held_context += produced
        session.remaining_tokens = 0.0
        session.phase = TOOL
        end_s = session.phase_end_s = self.now_s + session.plan.tool_s[session.turn]  # _push_timer, inline
        self._seq += 1
        heapq.heappush(self._timers, (end_s, self._seq, session))
        waiting = self._waiting
        while waiting and (not self._decode or self._decode_context + waiting[0].context_tokens <= self.kv_capacity):
            self._push_decode(waiting.pop(0))

    def _push_timer(self, end_s: float, session: Session) -> None:
        session.phase_end_s = end_s
        self._seq += 1
        heapq.heappush(self._timers, (end_s, self._seq, session))

