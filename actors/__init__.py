"""Gyre's actors, in four wings that line up with the message modules and talk to each other only by messages:

- `gyre.actors.serving`: the proxy, the agents' OpenAI/Anthropic face, routing every model call to a rollout cell;
- `gyre.actors.cells`: the cells (rollout or train role), the weight broker and the KV migrator;
- `gyre.actors.training`: the micro-step claimer, the scheduler, the trajectory builder and the run monitor;
- `gyre.actors.executions`: the task source, the executor that runs agents, and the evaluator that scores them.

No wing imports another. Each wing's package exports its actors and their configs.
"""

__all__: list[str] = []
