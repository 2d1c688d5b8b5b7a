"""Gradients between training cells by collectives: what satellites and the core say around a reduction round.

A satellite keeps its micro-steps' gradients summed in its trainer and tells the core what it holds
(`GradientsHeld`); the core, when a step's micro-steps are all computed (or a satellite wants to leave,
`FlushGradients`), asks the holders to join a round (`JoinReduction`), runs its side, counts what the round summed
and tells each member how it ended (`RoundEnded`). The bytes move over torch.distributed (engines/grad_exchange.py),
never on the bus.
"""

from __future__ import annotations

from gyre.messages._define import message


@message("gyre.gradient_rounds.GradientsHeld")
class GradientsHeld:
    """Satellite -> core: this micro-step's gradients are summed into my trainer, waiting for a round."""

    cell: str
    """The satellite."""
    step_id: int
    """Its step."""
    microstep_index: int
    """Its index."""
    num_tokens: int
    """Tokens forwarded (for the step's metrics)."""
    loss: float
    """The micro-step's loss (for the step's metrics)."""
    after_round: int
    """The last round the satellite joined before computing it (0: none): a round the core runs later with this
    satellite either counts it or hands it back, so a report older than the satellite's last round is void."""


@message("gyre.gradient_rounds.JoinReduction", version=3)
class JoinReduction:
    """Core -> satellite: bring the gradients you hold to round `round_id` (group `group_id`, this rank)."""

    round_id: int
    """The round (increasing from 1)."""
    group_id: int
    """The process group (a new id whenever the membership changes or a round failed)."""
    rank: int
    """This satellite's rank (the core is 0)."""
    size: int
    """Members, the core included."""
    store_host: str
    """The core's rendezvous store (TCPStore) address."""
    store_port: int
    """Its port."""
    numel: int
    """Elements of the flat gradient buffer (a satellite that holds no trainer any more joins with zeros); of global
    rank 0's shard when the core's trainer spans several processes."""
    layout: tuple[int, int, int, int] = (1, 1, 1, 1)
    """The core's training layout (tensor, pipeline, data, expert sizes): a member must train the same one."""
    lane_numels: tuple[int, ...] = ()
    """Elements of each global rank's gradient buffer (lane g reduces rank g's shard of every cell); () is
    `(numel,)`, one lane."""


@message("gyre.gradient_rounds.FlushGradients")
class FlushGradients:
    """Satellite -> core (ask, answered with the RoundEnded of the round that took the buffer): I am leaving the
    train role; take what I hold in a round now."""

    cell: str
    """The satellite."""
    after_round: int
    """The last round it joined: a round later than it took the buffer already."""


@message("gyre.gradient_rounds.RoundEnded")
class RoundEnded:
    """Core -> each member of a round: how it ended (the member's buffer is zeroed whatever the outcome)."""

    round_id: int
    """The round."""
    counted: bool
    """True: the micro-steps it summed are in the core's step; False: they went back to the claimer."""
    microsteps: int
    """Micro-steps the round counted in (or handed back)."""
    reason: str
    """Why it was not counted ("" when it was)."""


@message("gyre.gradient_rounds.RoundFinished")
class RoundFinished:
    """Core -> itself: a round it ran in the background ended; apply what is complete (in a handler, so a stop waits
    for the step and its checkpoint as it does for any handler)."""

    round_id: int
    """The round (0: none ran)."""
