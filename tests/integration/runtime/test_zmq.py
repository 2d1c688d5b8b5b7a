"""A node behind ZeroMQ survives whatever a member of the run pushes to its socket: garbage frames are counted and
dropped, an ask it cannot read gets an error reply, and the node keeps serving (processes outside the run get
nothing through at all: test_bus_security.py). Nodes with different views of the registry (an
unknown type, another schema version) answer with typed errors instead of misreading."""

from __future__ import annotations

import random

import attrs
import msgpack
import pytest
import zmq

from gyre.messages import REGISTERED
from gyre.messages.ping_pong import Ball, Echo, Score, ScoreAsked
from gyre.runtime import Actor, Codec, Envelope, Kind, RemoteError, Topology, handler
from gyre.runtime.envelope import ID_STRIDE
from gyre.runtime.testing import Harness, run_actors
from gyre.runtime.topology import CLIENT_INDEX_BASE
from gyre.runtime.zmq_transport import derived_bus_keys

pytestmark = pytest.mark.timeout(60)


class Keeper(Actor):
    """Counts balls, answers score asks, echoes."""

    async def on_start(self) -> None:
        self.balls = 0

    @handler(Ball)
    def on_ball(self, msg: Ball) -> None:
        self.balls += 1

    @handler(ScoreAsked)
    def on_score(self, msg: ScoreAsked) -> Score:
        return Score(self.balls)

    @handler(Echo)
    def on_echo(self, msg: Echo) -> Echo:
        return msg


def _topology() -> Topology:
    topology = Topology("zmq-test", seed=5)
    topology.add("keeper", Keeper)  # its own process group: node "keeper"
    return topology


def _garbage_frame_sets(codec: Codec) -> list[list[bytes]]:
    """Frame sets a broken or hostile peer might push (as the launcher's node, which hosts the supervisor)."""
    good_header, good_body = codec.encode(
        Envelope(ID_STRIDE + 1, "supervisor", "keeper", "", 0.0, 0, 0, Kind.TELL), Ball(1, 1)
    )
    fields = list(msgpack.unpackb(good_header))
    unknown_type = list(fields)
    unknown_type[9] = "gyre.nobody.Knows"
    other_format = list(fields)
    other_format[0] = 99
    other_version = list(fields)
    other_version[10] = 7
    frame_sets = [
        [b""],
        [b"one frame"],
        [b"three", b"frames", b"here"],
        [b"\xc1", good_body],
        [good_header[:-3], good_body],
        [msgpack.packb(other_format), good_body],
        [msgpack.packb(unknown_type), good_body],
        [msgpack.packb(other_version), good_body],
        [good_header, b"\xc1\xc1"],
        [good_header, good_body[:-1]],
        [good_header, msgpack.packb(["not", "ints"])],
    ]
    rng = random.Random(0)
    for _ in range(40):
        frame_sets.append([rng.randbytes(rng.randrange(0, 60)), rng.randbytes(rng.randrange(0, 60))])
    return frame_sets


def test_garbage_on_the_socket_never_stops_the_node_and_unreadable_asks_get_an_error_reply() -> None:
    codec = Codec()
    frame_sets = _garbage_frame_sets(codec)
    # An ask from the driver's client whose body is garbage: the keeper's node must answer it with an error.
    client = "~client.launcher"
    ask_header, _ = codec.encode(Envelope(CLIENT_INDEX_BASE * ID_STRIDE + 999, client, "keeper", "", 0.0, 0, 0,
                                          Kind.ASK), ScoreAsked())

    async def driver(h: Harness) -> tuple:
        keeper_node = h.node_of("keeper")
        launcher_node = h.nodes["launcher"]
        socket = zmq.Context.instance().socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        # A broken member of the run, not an outsider: it holds the launcher node's keys (the harness derives every
        # node's keys from this process's run secret).
        keys = derived_bus_keys("launcher", h.nodes)
        socket.setsockopt(zmq.CURVE_SERVERKEY, keys.public_keys["keeper"])
        socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.public_key)
        socket.setsockopt(zmq.CURVE_SECRETKEY, keys.secret_key)
        socket.connect(h.endpoint("keeper"))
        try:
            for frames in frame_sets:
                socket.send_multipart(frames)
            socket.send_multipart([ask_header, b"\xc1garbage"])
            h.tell("keeper", Ball(1, 0))
            await h.wait_until(lambda: keeper_node.statistics["bad_frames"] >= len(frame_sets) + 1, 20.0,
                               "every bad frame set")
            # The error reply reached the client's node; no ask of ours was waiting for it, so it counts as late.
            await h.wait_until(lambda: launcher_node.statistics["late_replies"] >= 1, 20.0, "the error reply")
        finally:
            socket.close()
        score = await h.ask("keeper", ScoreAsked(), timeout_s=10.0)
        echo = await h.ask("keeper", Echo(5, b"still here"), timeout_s=10.0)
        return keeper_node.statistics["bad_frames"], score.returned, echo, h.status("keeper")

    bad, returned, echo, status = run_actors(_topology(), driver, transport="zmq").value
    assert bad == len(frame_sets) + 1
    assert (returned, echo, status) == (1, Echo(5, b"still here"), "running")


class _GarblingCodec(Codec):
    """A codec that spoils the body of one message type on the way out (a peer with a broken encoder)."""

    def __init__(self, spoil: type) -> None:
        super().__init__()
        self._spoil = spoil

    def encode(self, envelope, msg):
        header, body = super().encode(envelope, msg)
        return (header, b"\xc1" + body) if type(msg) is self._spoil else (header, body)


def _ask_error(codecs: dict[str, Codec], msg) -> str:
    async def driver(h: Harness) -> tuple:
        with pytest.raises(RemoteError) as caught:
            await h.ask("keeper", msg, timeout_s=10.0)
        echo = await h.ask("keeper", Echo(1, b"ok"), timeout_s=10.0)  # the keeper goes on serving
        return caught.value.error_type, echo

    error_type, echo = run_actors(_topology(), driver, transport="zmq", codecs=codecs).value
    assert echo == Echo(1, b"ok")
    return error_type


def test_an_ask_the_receiver_cannot_decode_gets_malformed_frame_back() -> None:
    assert _ask_error({"launcher": _GarblingCodec(ScoreAsked)}, ScoreAsked()) == "MalformedFrame"


def test_a_reply_the_asker_cannot_decode_fails_the_ask() -> None:
    assert _ask_error({"keeper": _GarblingCodec(Score)}, ScoreAsked()) == "MalformedFrame"


def test_a_type_the_receiver_does_not_know_is_refused_by_name() -> None:
    without_score_asked = Codec([cls for cls in REGISTERED if cls is not ScoreAsked])
    assert _ask_error({"keeper": without_score_asked}, ScoreAsked()) == "UnknownMessageType"


def test_a_schema_version_the_receiver_does_not_speak_is_refused() -> None:
    @attrs.frozen(slots=True)
    class ScoreAskedV2:
        pass

    ScoreAskedV2.__gyre_type__, ScoreAskedV2.__gyre_version__ = ScoreAsked.__gyre_type__, 2
    newer = Codec([ScoreAskedV2 if cls is ScoreAsked else cls for cls in REGISTERED])
    assert _ask_error({"launcher": newer}, ScoreAskedV2()) == "SchemaVersionMismatch"
