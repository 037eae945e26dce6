"""``python ...`` runs that pay for importing torch and megatron-core once: a fork server.

A fresh interpreter spends several CPU seconds importing torch, megatron-core and this package before it runs a
line of a docs block or a demo. :func:`run_python` gives the tests what ``subprocess.run([sys.executable, *args],
capture_output=True, text=True)`` gives (exit status, stdout, stderr, ``subprocess.TimeoutExpired`` past the
time limit), but the process is forked from one server that imported those packages once: the child gets a fresh
``__main__`` namespace, its own working directory, ``sys.argv``, environment and ``sys.path`` (the script's folder
first, the environment's ``PYTHONPATH`` next), default signal handlers, the caller's stdin, stdout and stderr, and
exits as the interpreter does (non-daemon threads joined, ``atexit`` handlers run).

Programs that start Python themselves (the Slurm recipe's ``$PYTHON``) get :func:`python_executable`: a small
executable that asks the server for the same fork, passing its own standard streams, and exits with the child's
status; a child's ``sys.executable`` is that executable too, so the processes it starts are forked as well.

What a forked child cannot reproduce is left to a real interpreter, which runs instead: interpreter options
(``-S``, ``-I``...), a ``PYTHONPATH`` that would import another copy of an already imported package, and output
of the imports themselves (megatron-core warns when it is imported: a test that reads those warnings starts its
own process). Signals sent to the caller are not passed on to the child (a test that signals a run starts its
own process). The server starts on the first call, in the environment of the test session, and ends with it.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
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

# The client side of one run (this module's run_python and the executable): send the request and the three
# standard streams' descriptors, read the reply. Kept to the standard library's socket and json: the executable
# starts with `python -S` and must not import more.
CLIENT = r'''
import json, os, socket


def ask(address, request, fds):
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(address)
    socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], list(fds))
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = connection.recv(4096)
        if not chunk:
            break
        reply += chunk
    connection.close()
    return json.loads(reply) if reply else {"returncode": 1, "timed_out": False, "error": "no reply"}
'''

EXECUTABLE = r'''
import os, sys
REAL, ADDRESS = @REAL@, @ADDRESS@
''' + CLIENT + r'''
args = sys.argv[1:]
if not args or (args[0].startswith("-") and args[0] not in ("-c", "-m")):
    os.execv(REAL, [REAL, *args])
reply = ask(ADDRESS, {"args": args, "cwd": os.getcwd(), "env": dict(os.environ), "timeout": None}, (0, 1, 2))
if reply.get("exec"):
    os.execv(REAL, [REAL, *args])
code = reply["returncode"]
if code < 0:
    os.kill(os.getpid(), -code)
sys.exit(code)
'''

SERVER = CLIENT + r'''
import atexit, gc, importlib, runpy, signal, sys, threading, time, traceback, warnings

address, executable = sys.argv[1], sys.argv[2]
preimported, loaded_packages = json.loads(sys.argv[3]), json.loads(sys.argv[4])
fresh_filters = list(warnings.filters)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for name in preimported:
        try:
            importlib.import_module(name)
        except Exception:
            pass
sys.stdout.flush(); sys.stderr.flush()
# The children inherit the imported heap frozen: their garbage collector never walks it (nor copies its pages).
gc.freeze()
base_path = list(sys.path[1:])
own_path = set(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))


def holds_loaded_package(entry):
    return any(os.path.exists(os.path.join(entry, package)) for package in loaded_packages)


def forkable(env):
    """False when the child's PYTHONPATH would import another copy of a package the server has loaded (an entry
    it adds, or one of the server's it leaves out)."""
    paths = set(filter(None, env.get("PYTHONPATH", "").split(os.pathsep)))
    if any(holds_loaded_package(entry) for entry in own_path - paths):
        return False
    for entry in paths:
        if entry in own_path:
            continue
        for package in loaded_packages:
            module = sys.modules.get(package)
            there = os.path.realpath(os.path.join(entry, package))
            if os.path.exists(there) and (module is None or not os.path.realpath(module.__file__).startswith(there)):
                return False
    return True


def run(request, fds):
    """In the forked child: become the program, as `python *args` would start it; never returns."""
    for fd, target in zip(fds, (0, 1, 2)):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE, signal.SIGCHLD):
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
    sys.executable = executable  # the processes it starts with sys.executable are forked too
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


def serve_one(connection):
    """In a process forked per connection: fork the program, wait for it (within the time limit), reply."""
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    while not message.endswith(b"\n"):
        message += connection.recv(1 << 20)
    request = json.loads(message)
    if not forkable(request["env"]):
        connection.sendall(json.dumps({"exec": True}).encode() + b"\n")
        return
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        connection.close()
        os.setsid()  # its own process group: a time limit ends it and every process it started
        try:
            run(request, fds)
        finally:
            os._exit(70)
    for fd in fds:
        os.close(fd)
    deadline = time.monotonic() + request["timeout"] if request["timeout"] else None
    timed_out = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            break
        if deadline is not None and time.monotonic() > deadline:
            timed_out, returncode = True, -signal.SIGKILL
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.01)
    try:
        os.killpg(pid, signal.SIGKILL)  # what the program started and left behind, as a finished job leaves none
    except (ProcessLookupError, PermissionError):
        pass
    connection.sendall(json.dumps({"returncode": returncode, "timed_out": timed_out}).encode() + b"\n")




def reap(block=False):
    """Wait for the finished per-connection processes (so that their CPU time is counted in the server's)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def stop(signum, frame):
    raise SystemExit(0)


signal.signal(signal.SIGTERM, stop)
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(address)
listener.listen(64)
print("ready", flush=True)
session = os.getppid()
listener.settimeout(1.0)
try:
    while os.getppid() == session:  # the test session ended, however it ended: so does the server
        reap()
        try:
            connection, _ = listener.accept()
        except socket.timeout:
            continue
        connection.settimeout(None)
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            listener.close()
            try:
                serve_one(connection)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(0)
        connection.close()
finally:
    reap(block=True)
'''

_namespace: dict = {}
exec(CLIENT, _namespace)
_ask = _namespace["ask"]


class _Server:
    """One server per test session (started on first use, stopped at exit), listening on a UNIX socket."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="twinkle-fork-server-")
        self.address = os.path.join(self.folder, "socket")
        self.executable = os.path.join(self.folder, "python")
        client = EXECUTABLE.replace("@REAL@", repr(sys.executable)).replace("@ADDRESS@", repr(self.address))
        Path(self.executable).write_text(f"#!{sys.executable} -S\n{client}")
        os.chmod(self.executable, 0o755)
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER, self.address, self.executable, json.dumps(PREIMPORTED),
             json.dumps(LOADED_PACKAGES)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
            start_new_session=True)
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the fork server did not start (exit status {self.process.wait()})")
        atexit.register(self.stop)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        for name in ("socket", "python"):
            try:
                os.unlink(os.path.join(self.folder, name))
            except FileNotFoundError:
                pass
        os.rmdir(self.folder)


_server: Optional[_Server] = None


def _running_server() -> _Server:
    global _server
    if _server is None or _server.process.poll() is not None:
        _server = _Server()
    return _server


def python_executable() -> str:
    """An executable that runs ``python ARGS...`` forked from the session's server (for ``PYTHON=`` variables)."""
    return _running_server().executable


def run_python(args: Sequence[str], *, cwd: os.PathLike | str, env: Optional[dict] = None,
               timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)``, forked from the session's server when a fork runs it as a fresh interpreter would."""
    env = dict(os.environ if env is None else env)
    command = [sys.executable, *args]
    forkable = bool(args) and (not args[0].startswith("-") or args[0] in ("-c", "-m")) and \
        os.environ.get("TWINKLE_TESTS_NO_FORK_SERVER") != "1"
    if forkable:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull) as null:
            reply = _ask(_running_server().address, {"args": list(args), "cwd": os.fspath(cwd), "env": env,
                                                     "timeout": timeout}, (null.fileno(), out.fileno(), err.fileno()))
            if not reply.get("exec"):
                out.seek(0), err.seek(0)
                stdout, stderr = (stream.read().decode(errors="replace") for stream in (out, err))
                if reply["timed_out"]:
                    raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
                return subprocess.CompletedProcess(command, reply["returncode"], stdout, stderr)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)

