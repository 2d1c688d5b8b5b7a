"""The first program inside a bubblewrap sandbox (gyre.actors.executions.sandbox): drop to the sandbox's non-root
uid, start the proxy forwarder, run the command, exit with its status.

Run as `python3 -S -I sandbox_init.py --uid U --gid G [--listen PORT --socket PATH] [--drop NAME,...] -- argv...`. Standard library
only, and no import of gyre: it runs under `-I` inside a mount namespace where only the host root (read-only) is
guaranteed. The forwarder listens on 127.0.0.1:PORT in the sandbox's own network namespace (nothing else is
reachable there) and pipes every connection to the unix socket the host side mounted in, which leads to the proxy:
so an agent reaches its model at an ordinary http://127.0.0.1:PORT URL and nothing else. It runs after the uid drop,
as the same uid as the agent: an agent that kills it only loses its own model access.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

MAX_CONNECTIONS = 256
"""Forwarded connections open at once; an agent that opens more waits in the listen backlog (it cannot exhaust
the host's sockets through the forwarder)."""
CHUNK_BYTES = 65536


def _pipe(source: socket.socket, target: socket.socket) -> None:
    try:
        while chunk := source.recv(CHUNK_BYTES):
            target.sendall(chunk)
    except OSError:
        pass
    finally:
        for sock, how in ((target, socket.SHUT_WR), (source, socket.SHUT_RD)):
            try:
                sock.shutdown(how)
            except OSError:
                pass


def _serve(listener: socket.socket, socket_path: str, slots: threading.BoundedSemaphore) -> None:
    while True:
        client, _ = listener.accept()
        slots.acquire()
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(socket_path)
        except OSError:
            client.close()
            upstream.close()
            slots.release()
            continue

        def both(client: socket.socket = client, upstream: socket.socket = upstream) -> None:
            back = threading.Thread(target=_pipe, args=(upstream, client), daemon=True)
            back.start()
            _pipe(client, upstream)
            back.join()
            client.close()
            upstream.close()
            slots.release()

        threading.Thread(target=both, daemon=True).start()


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("sandbox_init: usage: --uid U --gid G [--listen PORT --socket PATH] -- command...", file=sys.stderr)
        return 125
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1:]
    values = dict(zip(options[::2], options[1::2]))
    uid, gid = int(values["--uid"]), int(values["--gid"])
    listener = None
    if "--listen" in values:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", int(values["--listen"])))
        listener.listen(64)
    # Groups first, then the gid, then the uid: after setresuid a process can no longer change the others. Leaving
    # root drops every capability, so the agent below cannot undo any of this.
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if listener is not None:
        slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        threading.Thread(target=_serve, args=(listener, values["--socket"], slots), daemon=True).start()
    if not command:
        return 0
    try:
        # The interpreter's locale coercion (PEP 538) may have added LC_CTYPE; the command gets only what was declared.
        env = {k: v for k, v in os.environ.items() if k not in values.get("--drop", "").split(",")}
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env)
    except OSError as error:
        print(f"sandbox_init: cannot run {command[0]!r}: {error}", file=sys.stderr)
        return 127
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, frame: child.send_signal(number))
    code = child.wait()
    return 128 - code if code < 0 else code  # a shell's convention for a child killed by a signal


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
