"""gyre simulate: the real control plane (scheduler and policy, micro-step claimer, task source) over emulated GPU
cells and agents in virtual time, to compare scheduling policies and plan a cluster (see cli.py, harness.py)."""

from gyre.simulate.agents import EmulatedAgents
from gyre.simulate.cells import EmulatedCell
from gyre.simulate.hardware import HARDWARE, CellModel, ModelProfile
from gyre.simulate.harness import Setup, compare, lower_bound
from gyre.simulate.workloads import WORKLOADS, Workload

__all__ = ["CellModel", "EmulatedAgents", "EmulatedCell", "HARDWARE", "ModelProfile", "Setup", "WORKLOADS", "Workload",
           "compare", "lower_bound"]
