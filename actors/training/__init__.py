"""The training wing: the micro-step claimer (the exactly-once ledger of each optimizer step's micro-steps), the
scheduler (hosts a scheduling policy: which cell plays which role), the trajectory builder (one prefix-shared tree
per execution, cut into training samples), the run monitor (the run's curves and its end) and the checkpointer (a
run's full checkpoints)."""

from gyre.runtime.exports import lazy_exports

__all__ = [
    "Checkpointer",
    "CheckpointerConfig",
    "ClaimerConfig",
    "MicroStepClaimer",
    "RunMonitor",
    "RunMonitorConfig",
    "Scheduler",
    "SchedulerConfig",
    "TrajectoryBuilder",
    "TrajectoryBuilderConfig",
]

__getattr__, __dir__ = lazy_exports(__name__, {
    "Checkpointer": "checkpointer",
    "CheckpointerConfig": "checkpointer",
    "ClaimerConfig": "microstep_claimer",
    "MicroStepClaimer": "microstep_claimer",
    "RunMonitor": "run_monitor",
    "RunMonitorConfig": "run_monitor",
    "Scheduler": "scheduler",
    "SchedulerConfig": "scheduler",
    "TrajectoryBuilder": "trajectory_builder",
    "TrajectoryBuilderConfig": "trajectory_builder",
})
