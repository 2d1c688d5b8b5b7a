"""Process groups: an agent or a scorer runs as the leader of its own group, so stopping it stops every tool
process it started too (the executor, the evaluator and the toolbox's own scoring all stop their children so)."""

from __future__ import annotations

import asyncio
import os
import signal

from gyre.actors.executions.warm_launcher import LaunchedProcess

__all__ = ["signal_process_group", "stop_process_group"]


def signal_process_group(pgid: int, sig: int) -> bool:
    """Send `sig` to a process group; False if none of its processes is left."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


async def stop_process_group(process: asyncio.subprocess.Process | LaunchedProcess, grace_s: float) -> None:
    """SIGTERM the process's group, give the leader `grace_s` to exit, then SIGKILL whatever is left of the group
    and reap the leader."""
    if process.returncode is None:
        signal_process_group(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), grace_s)
        except asyncio.TimeoutError:
            pass
    signal_process_group(process.pid, signal.SIGKILL)
    await process.wait()
