"""Gyre's benchmarks: `gyre bench X` runs `gyre.benchmarks.X` (bus, engine, proxy, switch, policies, trajectories);
`studies/` holds one-off measurement scripts (`python -m gyre.benchmarks.studies.NAME`). Results: BENCHMARKS.md."""

__all__: list[str] = []
