"""The fork server (stalwart.forkserver): which commands it runs, and the processes it forks as the agent sees
them: arguments, environment, exit codes, signals, command lines, and every failure of the server itself
ending in plain processes, never in a lost rank that nobody watches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart.forkserver import ForkServer, Target, parse_command
from stalwart.procfs import process_state

PY = sys.executable


@pytest.mark.parametrize(("command", "expected"), [
    ([PY, "train.py", "--steps", "3"], Target((PY,), "train.py", None, ("--steps", "3"))),
    (["python3", "-u", "-m", "pkg.train", "-m", "x"], Target(("python3", "-u"), None, "pkg.train", ("-m", "x"))),
    (["/usr/bin/python3.11", "-X", "dev", "-W", "error", "t.py"],
     Target(("/usr/bin/python3.11", "-X", "dev", "-W", "error"), "t.py", None, ())),
    (["python", "-c", "print(1)"], None),  # no file to run as __main__
    (["python", "-q", "t.py"], None),  # an option it does not know: the command runs as it is
    (["python"], None),
    (["python", "-m"], None),
    (["python", "-u"], None),
    (["bash", "-c", "python t.py"], None),
    (["torchrun", "t.py"], None),
    ([], None),
], ids=["script", "module", "options", "dash-c", "unknown-option", "bare", "no-module", "no-script", "shell",
        "launcher", "empty"])
def test_which_commands_the_fork_server_runs(command: list[str], expected: Target | None) -> None:
    assert parse_command(command) == expected


def test_a_target_gives_back_the_command_as_written() -> None:
    for command in ([PY, "-u", "-m", "a.b", "--x", "1"], [PY, "t.py", "y"]):
        target = parse_command(command)
        assert target is not None and target.command() == command


CHILD = """\
import gc, json, os, random, sys
with open(os.environ.get("OUT", os.devnull), "a") as out:
    out.write(json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0], "rank": os.environ.get("RANK"),
                  "gone": os.environ.get("ONLY_IN_SERVER"), "random": random.random(), "pid": os.getpid(),
                  "torch": "torch" in sys.modules, "gc": [gc.isenabled(), gc.get_freeze_count()]}) + "\\n")
mode = os.environ.get("MODE", "")
if mode == "raise":
    raise RuntimeError("boom")
if mode == "sleep":
    import time
    time.sleep(60)
sys.exit(int(os.environ.get("CODE", "0")))
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    return path


@pytest.fixture
def server(script: Path) -> Iterator[ForkServer]:
    target = parse_command([PY, str(script), "--steps", "3"])
    assert target is not None
    fs = ForkServer.start(target, {**os.environ, "ONLY_IN_SERVER": "1"}, preload=("json",))
    yield fs
    for child in list(fs.children.values()):
        child.kill()
        child.wait(10)
    fs.close()
    assert fs.process.returncode is not None


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


def test_a_forked_child_runs_the_script_as_main_with_its_own_arguments_and_environment(
        server: ForkServer, script: Path, tmp_path: Path) -> None:
    import json

    out = tmp_path / "out.jsonl"
    a = server.spawn(_env(RANK="3", OUT=str(out)))
    b = server.spawn(_env(RANK="4", OUT=str(out)))
    assert a is not None and b is not None
    assert (a.wait(30), b.wait(30)) == (0, 0)
    seen = [json.loads(line) for line in out.read_text().splitlines()]
    assert {s["rank"] for s in seen} == {"3", "4"}
    for s in seen:
        assert s["argv"] == [str(script), "--steps", "3"] and s["name"] == "__main__"
        assert s["path0"] == str(script.parent)
        assert s["gone"] is None  # the server's environment is replaced, not merged
        assert s["pid"] in (a.pid, b.pid)
    assert seen[0]["random"] != seen[1]["random"]  # seeded afresh, as a new process is
    # The server imported with its collector off and froze what it imported: the child's collector is on, and
    # its collections skip the preloaded heap (torch's objects: far more than 10,000).
    assert all(s["gc"][0] is True and s["gc"][1] > 10_000 for s in seen), [s["gc"] for s in seen]


def test_a_spawn_may_name_another_script_and_its_own_output_and_error(server: ForkServer, tmp_path: Path) -> None:
    other = tmp_path / "other.py"
    other.write_text("import sys\nprint('out', sys.argv[1:])\nprint('err', sys.argv[1:], file=sys.stderr)\n")
    target = parse_command([PY, str(other), "--x", "1"])
    assert target is not None
    with open(tmp_path / "out.txt", "wb") as out, open(tmp_path / "err.txt", "wb") as err:
        child = server.spawn(_env(), target=target, stdout=out.fileno(), stderr=err.fileno())
    assert child is not None and child.args == target.command()
    assert child.wait(30) == 0
    assert (tmp_path / "out.txt").read_text() == "out ['--x', '1']\n"
    assert (tmp_path / "err.txt").read_text() == "err ['--x', '1']\n"
    # The server's own target and streams are untouched by it: the next child runs the server's script.
    plain = server.spawn(_env(OUT=str(tmp_path / "plain.jsonl")))
    assert plain is not None and plain.wait(30) == 0
    assert '"--steps", "3"' in (tmp_path / "plain.jsonl").read_text()


@pytest.mark.parametrize(("env", "code"), [({"CODE": "0"}, 0), ({"CODE": "3"}, 3), ({"MODE": "raise"}, 1)],
                         ids=["ok", "exit-3", "exception"])
def test_a_forked_childs_exit_code_is_the_scripts(server: ForkServer, env: dict[str, str], code: int) -> None:
    child = server.spawn(_env(**env))
    assert child is not None
    assert child.wait(30) == code
    assert child.poll() == code
    assert child.pid not in server.children


@pytest.mark.parametrize(("how", "code"), [("kill", -signal.SIGKILL), ("terminate", -signal.SIGTERM)])
def test_a_signalled_child_reports_the_signal_as_popen_does(server: ForkServer, how: str, code: int) -> None:
    child = server.spawn(_env(MODE="sleep"))
    assert child is not None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    getattr(child, how)()
    assert child.wait(30) == code
    child.kill()  # after the exit: its pid may be anyone's now, and nothing is sent


def test_a_forked_child_shows_the_training_command_in_ps(server: ForkServer, script: Path) -> None:
    child = server.spawn(_env(MODE="sleep"))
    assert child is not None
    deadline = time.monotonic() + 30
    want = f"{PY}\0{script}\0--steps\0003\0".encode()
    while not (cmdline := Path(f"/proc/{child.pid}/cmdline").read_bytes()).startswith(want):
        assert time.monotonic() < deadline, cmdline
        time.sleep(0.05)
    assert cmdline.rstrip(b"\0") == want.rstrip(b"\0")
    assert b"stalwart.forkserver" in Path(f"/proc/{server.process.pid}/cmdline").read_bytes()


def test_a_lost_server_kills_what_it_started_and_the_next_spawn_is_refused(server: ForkServer) -> None:
    child = server.spawn(_env(MODE="sleep"))
    assert child is not None
    server.process.kill()
    # Nobody would learn this child's exit code: it is ended, and reported killed.
    assert child.wait(30) == -signal.SIGKILL
    assert process_state(child.pid) in ("", "Z")
    assert server.spawn(_env()) is None
    assert server.dead


def test_a_server_not_ready_within_its_deadline_is_given_up(tmp_path: Path, script: Path) -> None:
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(60)\n")
    target = parse_command([PY, str(script)])
    assert target is not None
    fs = ForkServer.start(target, _env(PYTHONPATH=str(tmp_path)), preload=("slow_import",))
    fs.ready_timeout = 0.5
    try:
        assert fs.spawn(_env()) is None
        assert fs.dead
        assert fs.process.wait(10) == -signal.SIGKILL
    finally:
        fs.close()


def test_a_server_whose_preloads_start_a_thread_does_not_fork(tmp_path: Path, script: Path,
                                                              capfd: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "threaded.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    target = parse_command([PY, str(script)])
    assert target is not None
    fs = ForkServer.start(target, _env(PYTHONPATH=str(tmp_path)), preload=("threaded",))
    try:
        assert fs.spawn(_env()) is None
        assert fs.dead
        fs.process.wait(10)
    finally:
        fs.close()
    assert "threads after preloading (MainThread, Thread-1" in capfd.readouterr().err


def test_a_server_that_loaded_the_cuda_driver_does_not_fork(tmp_path: Path, script: Path,
                                                             capfd: pytest.CaptureFixture[str]) -> None:
    # The driver does not survive a fork. A file mapped under the driver's name stands in for it here (the
    # check reads what /proc/self/maps lists).
    (tmp_path / "libcuda.so.1").write_bytes(b"\0" * 4096)
    (tmp_path / "loads_driver.py").write_text(
        "import mmap\n"
        f"_f = open({str(tmp_path / 'libcuda.so.1')!r}, 'rb')\n"
        "_m = mmap.mmap(_f.fileno(), 4096, prot=mmap.PROT_READ)\n")
    target = parse_command([PY, str(script)])
    assert target is not None
    fs = ForkServer.start(target, _env(PYTHONPATH=str(tmp_path)), preload=("loads_driver",))
    try:
        assert fs.spawn(_env()) is None and fs.dead
        fs.process.wait(10)
    finally:
        fs.close()
    assert "the CUDA driver was loaded while preloading" in capfd.readouterr().err


def test_a_module_target_runs_as_python_dash_m(tmp_path: Path) -> None:
    pkg = tmp_path / "pkgx"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "main.py").write_text(f"import sys\nopen({str(tmp_path / 'ran')!r}, 'w').write(f'{{__name__}} "
                                 f"{{sys.argv[1:]}} {{sys.argv[0]}}')\n")
    target = parse_command([PY, "-m", "pkgx.main", "a", "b"])
    assert target is not None
    fs = ForkServer.start(target, _env(PYTHONPATH=str(tmp_path)), preload=())
    try:
        child = fs.spawn(_env(PYTHONPATH=str(tmp_path)))
        assert child is not None and child.wait(30) == 0
    finally:
        fs.close()
    assert (tmp_path / "ran").read_text() == f"__main__ ['a', 'b'] {pkg / 'main.py'}"


def test_closing_the_server_ends_its_process(script: Path) -> None:
    target = parse_command([PY, str(script)])
    assert target is not None
    fs = ForkServer.start(target, _env(), preload=())
    assert fs.wait_ready(30)
    fs.close()
    assert fs.process.returncode == 0
