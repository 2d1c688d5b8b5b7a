"""The warm launcher with a real fork server and real agent scripts: what a child sees, how it ends, and what
happens when the server goes away."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest

from gyre.actors.executions.process_groups import signal_process_group, stop_process_group
from gyre.actors.executions.warm_launcher_server import ScriptCache
from gyre.actors.executions.warm_launcher import (
    LaunchedProcess,
    LauncherClosed,
    LauncherDied,
    LauncherStartFailed,
    WarmLauncher,
    preload_problem,
)

PRELOAD = ("colorsys",)  # a stdlib module nothing else here imports: its presence in a child proves the preload


def with_launcher(test: Callable[[WarmLauncher], Awaitable[Any]], preload: tuple[str, ...] = PRELOAD) -> Any:
    async def main() -> Any:
        launcher = WarmLauncher()
        await launcher.start(preload)
        try:
            return await test(launcher)
        finally:
            await launcher.close()

    return asyncio.run(main())


def script(directory: Path, text: str, name: str = "agent.py") -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return path


async def launch(launcher: WarmLauncher, directory: Path, argv: list[str],
                 env: dict[str, str] | None = None) -> LaunchedProcess:
    base = {"PATH": os.environ.get("PATH", os.defpath)}
    return await launcher.launch([sys.executable, *argv], directory, {**base, **(env or {})},
                                 directory / "out.log", directory / "err.log")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _dies(pid: int, within_s: float = 10.0) -> bool:
    """Whether the process is gone (or a zombie) within `within_s`: a SIGKILL is delivered asynchronously."""
    deadline = time.monotonic() + within_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


async def _wait_for_file(path: Path, within_s: float = 20.0) -> str:
    deadline = time.monotonic() + within_s
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never appeared"
        await asyncio.sleep(0.01)
    return path.read_text()


RECORD = """
import json, os, sys
json.dump({
    "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "file": __file__, "name": __name__,
    "env": dict(os.environ), "stdin": sys.stdin.read(), "pgid": os.getpgid(0), "pid": os.getpid(),
    "preloaded": "colorsys" in sys.modules, "wave_before": "wave" in sys.modules,
}, open("seen.json", "w"))
import wave  # not preloaded: still importable
print("to stdout")
print("to stderr", file=sys.stderr)
"""


def test_argv_cwd_env_stdio_and_process_group_arrive_in_the_child(tmp_path: Path) -> None:
    agents = tmp_path / "agents"
    agents.mkdir()
    agent = script(agents, RECORD)
    work = tmp_path / "work"
    work.mkdir()

    async def test(launcher: WarmLauncher) -> LaunchedProcess:
        process = await launch(launcher, work, [str(agent), "the prompt", "--flag"], {"ONLY_THIS": "yes"})
        assert await process.wait() == 0
        return process

    process = with_launcher(test)
    seen = json.loads((work / "seen.json").read_text())
    assert seen["argv"] == [str(agent), "the prompt", "--flag"]
    assert Path(seen["cwd"]) == work.resolve()
    assert seen["path0"] == str(agents.resolve()) and seen["file"] == str(agent) and seen["name"] == "__main__"
    assert seen["env"] == {"PATH": os.environ.get("PATH", os.defpath), "ONLY_THIS": "yes"}  # exactly the env given
    assert seen["stdin"] == ""
    assert seen["pid"] == process.pid == seen["pgid"]  # its own process group, led by itself
    assert seen["preloaded"] and not seen["wave_before"]
    assert (work / "out.log").read_text() == "to stdout\n"
    assert (work / "err.log").read_text() == "to stderr\n"


def test_a_relative_script_is_found_in_the_cwd(tmp_path: Path) -> None:
    script(tmp_path, "import sys; print(sys.argv[1:])", name="local.py")

    async def test(launcher: WarmLauncher) -> int:
        assert launcher.accepts([sys.executable, "local.py"], cwd=tmp_path)
        return await (await launch(launcher, tmp_path, ["local.py", "x"])).wait()

    assert with_launcher(test) == 0
    assert (tmp_path / "out.log").read_text() == "['x']\n"


@pytest.mark.parametrize(
    "body, code, in_stderr",
    [
        ("pass", 0, ""),
        ("import sys; sys.exit(3)", 3, ""),
        ("import sys; sys.exit('msg')", 1, "msg\n"),
        ("raise RuntimeError('boom')", 1, "RuntimeError: boom"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9, ""),
        ("raise KeyboardInterrupt", -2, "KeyboardInterrupt"),
    ],
)
def test_exit_codes_are_the_interpreters(tmp_path: Path, body: str, code: int, in_stderr: str) -> None:
    agent = script(tmp_path, body)

    async def test(launcher: WarmLauncher) -> int:
        return await (await launch(launcher, tmp_path, [str(agent)])).wait()

    assert with_launcher(test) == code
    stderr = (tmp_path / "err.log").read_text()
    assert in_stderr in stderr
    if "boom" in in_stderr:
        assert stderr.startswith("Traceback (most recent call last):") and str(agent) in stderr


def test_a_missing_script_fails_like_the_interpreter(tmp_path: Path) -> None:
    async def test(launcher: WarmLauncher) -> int:
        return await (await launch(launcher, tmp_path, ["gone.py"])).wait()

    assert with_launcher(test) == 2
    assert "can't open file" in (tmp_path / "err.log").read_text()


MAIN_GLOBALS = """
import json, sys
def annotated() -> 1 + 1:
    pass
json.dump({
    "dunders": {name: repr(globals()[name]) for name in
                ("__name__", "__file__", "__cached__", "__doc__", "__loader__", "__package__", "__spec__")},
    "argv0": sys.argv[0], "is_main_module": sys.modules["__main__"].__dict__ is globals(),
    "annotation": repr(annotated.__annotations__["return"]),
}, open(sys.argv[1], "w"))
"""


def test_a_script_runs_with_the_globals_runpy_gives_it(tmp_path: Path) -> None:
    # The server compiles a script once and runs its code object in every child (warm_launcher_server's
    # ScriptCache): the child must see what runpy.run_path(script, run_name="__main__") gave it before, and the
    # server's own `from __future__ import annotations` must not reach the script (its annotation is evaluated).
    agent = script(tmp_path, MAIN_GLOBALS)

    async def test(launcher: WarmLauncher) -> list[int]:
        return [await (await launch(launcher, tmp_path, [str(agent), f"warm{n}.json"])).wait() for n in range(2)]

    assert with_launcher(test) == [0, 0]
    runpy_way = ("import runpy, sys; sys.argv = sys.argv[1:]; "
                 "runpy.run_path(sys.argv[0], run_name='__main__')")
    import subprocess

    subprocess.run([sys.executable, "-c", runpy_way, str(agent), "runpy.json"], cwd=tmp_path, check=True)
    expected = json.loads((tmp_path / "runpy.json").read_text())
    assert expected["annotation"] == "2" and expected["is_main_module"]
    for n in range(2):
        assert json.loads((tmp_path / f"warm{n}.json").read_text()) == expected


def test_a_changed_script_is_compiled_again(tmp_path: Path) -> None:
    agent = script(tmp_path, "print('first')")

    async def test(launcher: WarmLauncher) -> list[str]:
        outputs = []
        for text in ("print('first')", "print('first')", "print('the second version')"):
            agent.write_text(text)
            assert await (await launch(launcher, tmp_path, [str(agent)])).wait() == 0
            outputs.append((tmp_path / "out.log").read_text())
        return outputs

    assert with_launcher(test) == ["first\n", "first\n", "the second version\n"]


def test_the_script_cache_compiles_once_per_version_and_only_plain_python_files(tmp_path: Path) -> None:
    cache = ScriptCache(max_scripts=2)
    agent = script(tmp_path, "x = 1")
    first = cache.code_for(str(agent))
    assert first is not None and cache.code_for(str(agent)) is first  # compiled once
    agent.write_text("x = 22")  # another size: another version
    second = cache.code_for(str(agent))
    assert second is not None and second is not first and second.co_filename == str(agent)
    assert cache.code_for(str(script(tmp_path, "x = (", name="broken.py"))) is None  # runpy reports it
    assert cache.code_for(str(tmp_path / "missing.py")) is None
    assert cache.code_for(str(script(tmp_path, "x = 1", name="tool"))) is None  # not a .py file
    assert cache.code_for(str(tmp_path)) is None  # a directory
    for n in range(3):  # bounded: a full cache starts over
        assert cache.code_for(str(script(tmp_path, "y = 2", name=f"s{n}.py"))) is not None
    assert len(cache) <= 2


def test_a_script_that_does_not_compile_fails_like_the_interpreter(tmp_path: Path) -> None:
    agent = script(tmp_path, "x = (")

    async def test(launcher: WarmLauncher) -> int:
        return await (await launch(launcher, tmp_path, [str(agent)])).wait()

    assert with_launcher(test) == 1
    assert "SyntaxError" in (tmp_path / "err.log").read_text()


THREADS_AND_ATEXIT = """
import atexit, concurrent.futures, pathlib, threading, time
atexit.register(lambda: print("atexit ran"))
def late():
    time.sleep(0.2)
    pathlib.Path("thread.txt").write_text("done")
threading.Thread(target=late).start()
pool = concurrent.futures.ThreadPoolExecutor(2)  # never shut down: interpreter exit must still end its workers
pool.submit(print, "from the pool").result()
"""


def test_exit_waits_for_threads_then_runs_atexit(tmp_path: Path) -> None:
    agent = script(tmp_path, THREADS_AND_ATEXIT)

    async def test(launcher: WarmLauncher) -> int:
        return await asyncio.wait_for((await launch(launcher, tmp_path, [str(agent)])).wait(), 60)

    assert with_launcher(test) == 0
    assert (tmp_path / "thread.txt").read_text() == "done"
    assert (tmp_path / "out.log").read_text() == "from the pool\natexit ran\n"


SPAWN_GRANDCHILD = """
import pathlib, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
pathlib.Path("child.pid").write_text(str(child.pid))
time.sleep(600)
"""


def test_stopping_the_process_group_reaches_a_grandchild(tmp_path: Path) -> None:
    agent = script(tmp_path, SPAWN_GRANDCHILD)

    async def test(launcher: WarmLauncher) -> tuple[int, int]:
        process = await launch(launcher, tmp_path, [str(agent)])
        assert signal_process_group(process.pid, 0)  # its group exists as soon as launch() returns
        grandchild = int(await _wait_for_file(tmp_path / "child.pid"))
        assert process.returncode is None
        await stop_process_group(process, grace_s=5.0)  # type: ignore[arg-type]
        signal_process_group(process.pid, signal.SIGKILL)  # what the executor does after every agent
        return process.returncode, grandchild  # type: ignore[return-value]

    code, grandchild = with_launcher(test)
    assert code == -signal.SIGTERM
    assert _dies(grandchild)


def test_concurrent_launches_each_get_their_own_child(tmp_path: Path) -> None:
    agent = script(tmp_path, "import os, sys; open(sys.argv[1], 'w').write(os.environ['N'])")

    async def test(launcher: WarmLauncher) -> list[int]:
        runs = []
        for n in range(4):
            work = tmp_path / f"w{n}"
            work.mkdir()
            runs.append(launcher.launch([sys.executable, str(agent), "n.txt"], work, {"N": str(n)},
                                        work / "out", work / "err"))
        processes = await asyncio.gather(*runs)
        assert len({p.pid for p in processes}) == 4
        return [await p.wait() for p in processes]

    assert with_launcher(test) == [0, 0, 0, 0]
    assert [(tmp_path / f"w{n}" / "n.txt").read_text() for n in range(4)] == ["0", "1", "2", "3"]


def test_a_bad_cwd_is_an_oserror_and_the_server_goes_on(tmp_path: Path) -> None:
    agent = script(tmp_path, "pass")

    async def test(launcher: WarmLauncher) -> int:
        with pytest.raises(FileNotFoundError):
            await launch(launcher, tmp_path / "nowhere", [str(agent)])
        with pytest.raises(OSError):
            await launcher.launch([sys.executable, str(agent)], tmp_path, {}, tmp_path / "no" / "out", tmp_path / "e")
        assert launcher.alive
        return await (await launch(launcher, tmp_path, [str(agent)])).wait()

    assert with_launcher(test) == 0


def test_the_server_dying_kills_its_children_and_refuses_later_launches(tmp_path: Path) -> None:
    agent = script(tmp_path, SPAWN_GRANDCHILD)

    async def test(launcher: WarmLauncher) -> None:
        process = await launch(launcher, tmp_path, [str(agent)])
        grandchild = int(await _wait_for_file(tmp_path / "child.pid"))
        assert launcher.server_pid is not None
        os.kill(launcher.server_pid, signal.SIGKILL)
        assert await asyncio.wait_for(process.wait(), 30) == -9
        await launcher.wait_ended()
        assert launcher.died and not launcher.alive
        assert _dies(process.pid) and _dies(grandchild)
        with pytest.raises(LauncherDied):
            await launch(launcher, tmp_path, [str(agent)])

    with_launcher(test)


KILL_THE_SERVER_AT_ONCE = """
import os, pathlib, signal, time
pathlib.Path("child.pid").write_text(str(os.getpid()))
os.kill(os.getppid(), signal.SIGKILL)
time.sleep(600)
"""


@pytest.mark.parametrize("attempt", range(5))
def test_a_script_that_kills_the_server_at_once_is_still_a_child_the_client_knows_and_kills(
        tmp_path: Path, attempt: int) -> None:
    # Before the server held the script back until its pid reply was written, the kill could beat that reply: the
    # launch then failed with LauncherDied and the child slept on, unknown to anyone (a CI run hit it; with four
    # busy loops beside it, 22 of 30 of these attempts failed that way).
    agent = script(tmp_path, KILL_THE_SERVER_AT_ONCE)

    async def test(launcher: WarmLauncher) -> None:
        process = await launch(launcher, tmp_path, [str(agent)])
        assert await asyncio.wait_for(process.wait(), 30) == -9
        await launcher.wait_ended()
        assert launcher.died
        assert _dies(int(await _wait_for_file(tmp_path / "child.pid")))

    with_launcher(test)


def test_close_kills_live_children_and_refuses_later_launches(tmp_path: Path) -> None:
    agent = script(tmp_path, "import time; time.sleep(600)")

    async def main() -> None:
        launcher = WarmLauncher()
        await launcher.start(())
        process = await launch(launcher, tmp_path, [str(agent)])
        await launcher.close()
        assert process.returncode == -9 and _dies(process.pid)
        assert not launcher.alive and not launcher.died
        with pytest.raises(LauncherClosed):
            await launch(launcher, tmp_path, [str(agent)])
        assert isinstance(LauncherClosed(), OSError) and isinstance(LauncherDied(), OSError)

    asyncio.run(main())


def test_accepts_only_this_interpreter_running_an_existing_script(tmp_path: Path) -> None:
    agent = script(tmp_path, "pass")
    (tmp_path / "-odd.py").write_text("pass")
    launcher = WarmLauncher()
    assert launcher.accepts([sys.executable, str(agent), "prompt"])
    assert launcher.accepts((os.path.realpath(sys.executable), "agent.py"), cwd=tmp_path)
    assert not launcher.accepts([sys.executable, "-m", "json.tool"])
    assert not launcher.accepts([sys.executable, "-c", "pass"])
    assert not launcher.accepts([sys.executable, "-odd.py"], cwd=tmp_path)  # an option to the interpreter
    assert not launcher.accepts([sys.executable, str(tmp_path / "missing.py")])
    assert not launcher.accepts([sys.executable, str(tmp_path)])  # a directory
    assert not launcher.accepts([sys.executable])
    assert not launcher.accepts(["/bin/sh", str(agent)])
    assert not launcher.accepts(["no-such-program-anywhere", str(agent)])
    # Flags that only trim a fresh interpreter's start are dropped; any other option is not `python script`.
    assert launcher.accepts([sys.executable, "-S", "-B", str(agent), "-S"])
    assert not launcher.accepts([sys.executable, "-S"])
    assert not launcher.accepts([sys.executable, "-u", str(agent)])
    assert not launcher.accepts([sys.executable, "-S", "-c", "pass"])


def test_startup_flags_are_left_out_of_the_scripts_argv(tmp_path: Path) -> None:
    agent = script(tmp_path, "import json, sys; json.dump(sys.argv, open('argv.json', 'w'))")

    async def test(launcher: WarmLauncher) -> int:
        process = await launch(launcher, tmp_path, ["-S", "-s", str(agent), "-S", "x"])
        return await asyncio.wait_for(process.wait(), 30)

    assert with_launcher(test) == 0
    assert json.loads((tmp_path / "argv.json").read_text()) == [str(agent), "-S", "x"]


def test_a_preload_that_does_not_import_is_a_clear_error_at_start() -> None:
    async def main() -> None:
        launcher = WarmLauncher()
        with pytest.raises(LauncherStartFailed, match="no_such_module_for_gyre.*ModuleNotFoundError"):
            await launcher.start(("json", "no_such_module_for_gyre"))
        assert not launcher.alive
        with pytest.raises(ValueError, match="not a dotted module name"):
            await WarmLauncher().start(("openai,structlog",))

    asyncio.run(main())
    assert preload_problem(("a.b", "c_d")) is None
    assert preload_problem(["a"]) is not None and preload_problem(("",)) is not None


def test_preload_entries_may_name_a_warm_up_function_or_a_file() -> None:
    assert preload_problem(("gyre.actors.executions.sdk_warmup:openai_client", "json", "/x/agent.py")) is None
    for bad in ("a:b:c", "a:", ":f", "a.b:c.d", "a:1f", "x/agent.py", "/x/agent.txt", "/x,y/agent.py",
                "/x/agent.py:main"):
        assert preload_problem((bad,)) is not None, bad


SIBLING_LOADER = """
import importlib.util, json, os, pathlib, sys
NAME = "_test_toolbox_helper"
if NAME not in sys.modules:  # like examples/toolbox/agent.py's load_sibling
    spec = importlib.util.spec_from_file_location(NAME, pathlib.Path(__file__).with_name("helper.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module
    spec.loader.exec_module(module)
if __name__ == "__main__":
    json.dump({"helper_from": sys.modules[NAME].LOADED_BY, "me": os.getpid()}, open("seen.json", "w"))
"""


@pytest.mark.parametrize("preloaded", [True, False], ids=["preloaded", "not preloaded"])
def test_a_file_preloaded_by_path_brings_its_siblings_to_every_child(tmp_path: Path, preloaded: bool) -> None:
    script(tmp_path, "import os\nLOADED_BY = os.getpid()\n", name="helper.py")
    agent = script(tmp_path, SIBLING_LOADER)

    async def test(launcher: WarmLauncher) -> int:
        return await (await launch(launcher, tmp_path, [str(agent)])).wait()

    assert with_launcher(test, preload=PRELOAD + ((str(agent),) if preloaded else ())) == 0
    seen = json.loads((tmp_path / "seen.json").read_text())
    # Preloaded, the helper was imported once, by the server; otherwise by the child itself.
    assert (seen["helper_from"] != seen["me"]) is preloaded


def test_a_preloaded_file_that_fails_is_a_clear_error_at_start(tmp_path: Path) -> None:
    broken = script(tmp_path, "raise RuntimeError('no luck')", name="broken.py")

    async def main() -> None:
        launcher = WarmLauncher()
        with pytest.raises(LauncherStartFailed, match="broken.py.*RuntimeError: no luck"):
            await launcher.start((str(broken),))
        assert not launcher.alive

    asyncio.run(main())


def test_a_warm_up_runs_once_in_the_server_so_children_start_warm(tmp_path: Path) -> None:
    # The openai warm-up sends one refused request: the modules on the request path are imported in the server,
    # so a forked agent's first call imports nothing more.
    probe = script(tmp_path, """
        import json, sys
        json.dump({"chat": "openai.resources.chat.completions" in sys.modules}, open("seen.json", "w"))
        """)

    async def test(launcher: WarmLauncher) -> int:
        return await (await launch(launcher, tmp_path, [str(probe)])).wait()

    assert with_launcher(test, preload=("openai", "gyre.actors.executions.sdk_warmup:openai_client")) == 0
    assert json.loads((tmp_path / "seen.json").read_text()) == {"chat": True}


def test_a_warm_up_that_fails_is_a_clear_error_at_start() -> None:
    async def main() -> None:
        launcher = WarmLauncher()
        with pytest.raises(LauncherStartFailed, match="json:no_such_function.*AttributeError"):
            await launcher.start(("json:no_such_function",))
        assert not launcher.alive

    asyncio.run(main())
