"""Gyre's policies: the decisions of an RL run that are meant to be swapped, as typed Protocols, and the pure
functions they are built on.

A policy is a Protocol and the implementations Gyre ships; the actor that hosts it checks every answer against the
contract (`checked_choice`, `check_decisions`, `checked_weights`, ...) so that a policy breaking it fails loudly. A
topology file chooses the implementation; an actor in `gyre.actors` calls it with an immutable view of its own
state. Policies import only `gyre.messages` (plain data) and `gyre.runtime.errors`; nothing in `gyre.runtime` or
`gyre.engines` imports them.

- `routing`: which rollout cell serves a session's next model call (the proxy's router);
- `scheduling`: which cells roll out and which train (the scheduler);
- `staleness`: which samples may still train at a given step (the micro-step claimer);
- `task_sampling`: which task the next group runs (the task source);
- `group_filter`: when a group with dropped executions still trains (the trajectory builder);
- `trajectory_tree` and `trajectory_processor`: a scored execution's prefix-shared token tree and the bounded set
  of training samples made from it (the trajectory builder);
- `loss`: group-normalised advantages and the GSPO objective (the train role of a cell).

The modules are imported as `gyre.policies.<module>`; this package re-exports nothing from them (`loss` pulls in
torch). Its one public name is the layer's error base, `PolicyError`; every policy error, each also the builtin it
always was, lives in `gyre.policies.errors`.
"""

from gyre.policies.errors import PolicyError

__all__ = ["PolicyError"]
