"""The executions wing: the task source (which groups run, within the staleness bound), the executor (agent
processes in their own process groups and workspaces, with time limits; forked warm by `warm_launcher.py`) and the
evaluator (scorers on the preserved workspace; a crash or hang drops the execution). Both run their commands
through `sandbox.py` (backends none and bubblewrap); `harbor.py` loads Harbor task directories and `swe.py`
SWE-bench-style instances into TaskSpecs; `agents.py` holds the agents that run them (oracle, noop,
mini-swe-agent, any command-line agent from a small spec)."""

from gyre.runtime.exports import lazy_exports

__all__ = ["Evaluator", "EvaluatorConfig", "Executor", "ExecutorConfig", "TaskSource", "TaskSourceConfig"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "Evaluator": "evaluator",
    "EvaluatorConfig": "evaluator",
    "Executor": "executor",
    "ExecutorConfig": "executor",
    "TaskSource": "task_source",
    "TaskSourceConfig": "task_source",
})
