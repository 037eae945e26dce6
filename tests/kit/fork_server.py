"""``python ...`` runs that pay for importing torch and megatron-core once: a fork server.

A fresh interpreter spends several CPU seconds importing torch, megatron-core and this package before it runs a
line of a docs block or a demo. :func:`run_python` gives the tests what ``subprocess.run([sys.executable, *args],
capture_output=True, text=True)`` gives (exit status, stdout, stderr, ``subprocess.TimeoutExpired`` past the
time limit), but the process is forked from one server that imported those packages once: the child gets a fresh
``__main__`` namespace, its own working directory, ``sys.argv``, environment and ``sys.path`` (the script's folder
first, the environment's ``PYTHONPATH`` next), default signal handlers, stdin from ``/dev/null``, stdout and
stderr in files, and exits as the interpreter does (non-daemon threads joined, ``atexit`` handlers run).

What a forked child cannot reproduce is left to a real interpreter, which :func:`run_python` starts instead:
interpreter options (``-S``, ``-I``...), a ``PYTHONPATH`` that would import another copy of an already imported
package, and output of the imports themselves (megatron-core warns when it is imported: a test that reads those
warnings starts its own process). The server starts on the first call, in the environment of the test session,
and ends with it.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence

# Imported once by the server, before it forks: what the docs blocks, the demo and the examples import.
PREIMPORTED = ("torch", "numpy", "megatron.core", "megatron.core.parallel_state", "megatron.core.models.gpt",
               "megatron.core.optimizer", "megatron.core.distributed", "megatron.core.pipeline_parallel",
               "megatron.core.transformer", "twinkle_megatron", "twinkle_megatron.megatron", "twinkle_megatron.tracker",
               "twinkle_megatron.testing.cuda_shim", "twinkle_megatron.testing.distributed",
               "twinkle_megatron.testing.invariance", "twinkle_megatron.cli")
# The packages whose copy a child's PYTHONPATH must not change (their modules are already loaded).
LOADED_PACKAGES = ("torch", "megatron", "twinkle_megatron", "numpy")

SERVER = r'''
import atexit, importlib, json, os, runpy, signal, sys, threading, time, traceback, warnings

fresh_filters = list(warnings.filters)
replies = os.fdopen(os.dup(1), "w", buffering=1)
requests = os.fdopen(os.dup(0), "r")
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for name in json.loads(sys.argv[1]):
        try:
            importlib.import_module(name)
        except Exception:
            pass
sys.stdout.flush(); sys.stderr.flush()
base_path = list(sys.path[1:])


def child(request):
    os.setsid()  # its own process group: a time limit ends it and every process it started
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    for stream in (replies, requests):
        stream.close()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    args = request["args"]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if args[0] == "-c":
        first, sys.argv = "", ["-c", *args[2:]]
    elif args[0] == "-m":
        first, sys.argv = os.getcwd(), [args[1], *args[2:]]
    else:
        first, sys.argv = os.path.dirname(os.path.abspath(args[0])), list(args)
    sys.path[:] = [first, *[os.path.abspath(p) for p in extra], *[p for p in base_path if p not in extra]]
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    warnings.filters[:] = fresh_filters  # a fresh interpreter's filters, not those the imports left
    warnings._filters_mutated()
    code = 0
    try:
        if args[0] == "-c":
            main = type(sys)("__main__")
            sys.modules["__main__"] = main
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        elif args[0] == "-m":
            sys.modules.pop(args[1], None)  # a fresh interpreter has not imported the module it runs as __main__
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    try:
        sys.stdout.flush(); sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


for line in requests:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            child(request)
        finally:
            os._exit(70)
    deadline = time.monotonic() + request["timeout"] if request["timeout"] else None
    timed_out = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if deadline is not None and time.monotonic() > deadline:
            timed_out = True
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            status = -signal.SIGKILL
            break
        time.sleep(0.01)
    if timed_out:
        returncode = -signal.SIGKILL
    else:
        returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        try:
            os.killpg(pid, signal.SIGKILL)  # what the child started and left behind, as a finished job leaves none
        except (ProcessLookupError, PermissionError):
            pass
    replies.write(json.dumps({"returncode": returncode, "timed_out": timed_out}) + "\n")
'''


class _Server:
    """One server process per test session (started on first use, stopped at exit)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", SERVER, json.dumps(PREIMPORTED)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.lock = threading.Lock()
        atexit.register(self.stop)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def run(self, request: dict) -> dict:
        with self.lock:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            reply = self.process.stdout.readline()
        if not reply:
            raise RuntimeError(f"the fork server ended (exit status {self.process.poll()})")
        return json.loads(reply)


_server: Optional[_Server] = None


def _forkable(args: Sequence[str], env: dict) -> bool:
    """Whether a child forked from the server runs ``python *args`` in ``env`` as a fresh interpreter would."""
    if not args or (args[0].startswith("-") and args[0] not in ("-c", "-m")) or os.environ.get(
            "TWINKLE_TESTS_NO_FORK_SERVER") == "1":
        return False
    own = set(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    for entry in filter(None, env.get("PYTHONPATH", "").split(os.pathsep)):
        if entry in own:
            continue
        for package in LOADED_PACKAGES:  # another copy of a loaded package would be shadowed by the loaded one
            module = sys.modules.get(package)
            there = Path(entry) / package
            if there.exists() and (module is None or not str(Path(module.__file__).resolve()).startswith(
                    str(there.resolve()))):
                return False
    return True


def run_python(args: Sequence[str], *, cwd: os.PathLike | str, env: Optional[dict] = None,
               timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)``, forked from the session's server when a fork runs it as a fresh interpreter would."""
    global _server
    env = dict(os.environ if env is None else env)
    command = [sys.executable, *args]
    if not _forkable(args, env):
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if _server is None or _server.process.poll() is not None:
        _server = _Server()
    with tempfile.TemporaryDirectory(prefix="twinkle-fork-") as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        reply = _server.run({"args": list(args), "cwd": os.fspath(cwd), "env": env, "timeout": timeout,
                             "stdout": out, "stderr": err})
        stdout, stderr = (Path(path).read_text(errors="replace") if os.path.exists(path) else "" for path in (out, err))
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(command, reply["returncode"], stdout, stderr)
