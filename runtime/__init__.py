"""Gyre's actor runtime: actors, the bus, clocks, the event log, replay and launchers."""

from gyre.runtime.actor import Actor, NoConfig, handler
from gyre.runtime.clock import Clock, RealClock, VirtualClock
from gyre.runtime.codec import Codec
from gyre.runtime.envelope import Envelope, Kind
from gyre.runtime.errors import (
    ActorDead,
    AskTimeout,
    Backpressure,
    CodecError,
    GyreError,
    MalformedFrame,
    NoHandler,
    RemoteError,
    SchemaVersionMismatch,
    TopologyError,
    UnknownAddress,
    UnknownMessageType,
)
from gyre.runtime.event_log import EventLogWriter, LogRecord, read_log
from gyre.runtime.launch import InProcessLauncher, LocalProcessLauncher, RunOptions, RunResult, VirtualLauncher
from gyre.runtime.node import Node, NodeConfig
from gyre.runtime.topology import RestartPolicy, Topology

__all__ = [
    "Actor",
    "ActorDead",
    "AskTimeout",
    "Backpressure",
    "Clock",
    "Codec",
    "CodecError",
    "Envelope",
    "EventLogWriter",
    "GyreError",
    "InProcessLauncher",
    "Kind",
    "LocalProcessLauncher",
    "LogRecord",
    "MalformedFrame",
    "NoConfig",
    "NoHandler",
    "Node",
    "NodeConfig",
    "RealClock",
    "RemoteError",
    "RestartPolicy",
    "RunOptions",
    "RunResult",
    "SchemaVersionMismatch",
    "Topology",
    "TopologyError",
    "UnknownAddress",
    "UnknownMessageType",
    "VirtualClock",
    "VirtualLauncher",
    "handler",
    "read_log",
]
