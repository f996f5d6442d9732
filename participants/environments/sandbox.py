"""A real Python interpreter subprocess as a resource (restart_only).

The interpreter's namespace lives only in the child process, so after a crash
it is gone: rollouts that used it restart from turn 0. The child speaks JSON
lines over private duplicates of its stdin/stdout (user code printing or
reading stdin cannot corrupt the protocol) and exits when its stdin closes, so
it does not outlive a parent that dies: the pipe closes with the parent.
Hash randomisation is pinned so ``repr`` of sets is stable across runs.

Who is to blame when ``exec`` goes wrong decides what the rollout sees. The
model's code that raises, runs past ``timeout_s`` or ends the interpreter
(``while True: pass``, ``os._exit(1)``) is the policy's doing: the interpreter is
started again from the task's initial code and the mutation's result says what
happened (an observation the rollout goes on from, and is scored with). An
interpreter found dead before the code is sent, or one that does not answer a
query, is the infrastructure's: :class:`SandboxCrashedError` /
:class:`SandboxTimeoutError`, and the attempt fails (retried by the workload's
``failure_policy``). An outside kill that lands while the model's code runs is
counted as the policy's: the two cannot be told apart from here.
"""

from __future__ import annotations

import json
import logging
import os
import random
import select
import subprocess
import sys
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

from rollout_journal.journal.deadlines import Deadline
from rollout_journal.journal.errors import ConfigurationError
from rollout_journal.participants.environments.base import SUBMIT, Environment, StepMutations
from rollout_journal.participants.environments.tasks import Task
from rollout_journal.participants.resources import Recovery, Resource, ResourceError

__all__ = [
    "PythonSandbox",
    "SandboxEnvironment",
    "SandboxError",
    "SandboxClosedError",
    "SandboxCrashedError",
    "SandboxTimeoutError",
]

log = logging.getLogger(__name__)

MAX_STDOUT_CHARS = 4000  # results are journaled: keep one exec's output bounded
DEFAULT_TIMEOUT_S = 10.0  # one exec of the model's code
_QUERY_TIMEOUT_S = 30.0  # the sandbox's own requests (start-up code, vars): no model code runs in them
_SHUTDOWN_GRACE_S = 2.0

_REPL = r"""
import contextlib, io, json, os, sys
proto_in = os.fdopen(os.dup(0), "r", encoding="utf-8")
proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
_null = os.open(os.devnull, os.O_RDWR)
os.dup2(_null, 0)
os.dup2(_null, 1)
ns = {"__name__": "__sandbox__"}

def user_vars():
    out = {}
    for name in sorted(ns):
        if name.startswith("_"):
            continue
        value = ns[name]
        if isinstance(value, type(sys)) or callable(value):
            out[name] = "<%s>" % type(value).__name__
            continue
        try:
            out[name] = repr(value)
        except Exception:
            out[name] = "<unreprable %s>" % type(value).__name__
    return out

def run(code):
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(code, "<sandbox>", "exec"), ns)
        return {"ok": True, "stdout": buf.getvalue()}
    except BaseException as exc:
        return {"ok": False, "stdout": buf.getvalue(), "error": "%s: %s" % (type(exc).__name__, exc)}

for line in proto_in:
    req = json.loads(line)
    op = req.get("op")
    if op == "exec":
        resp = run(req["code"])
    elif op == "vars":
        resp = {"ok": True, "vars": user_vars()}
    else:
        resp = {"ok": False, "error": "unknown request %r" % (op,)}
    proto_out.write(json.dumps(resp) + "\n")
    proto_out.flush()
"""


class SandboxError(ResourceError):
    """The sandbox subprocess cannot serve the request."""


class SandboxClosedError(SandboxError):
    """The sandbox was closed (or died earlier); build a new one or reset() it."""


class SandboxCrashedError(SandboxError):
    """The sandbox subprocess exited unexpectedly."""


class SandboxTimeoutError(SandboxError):
    """The sandbox did not answer in time; it has been killed."""


class _SandboxExited(SandboxCrashedError):
    """The child exited while serving a request (after it was sent): what the request ran did it."""

    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(message)
        self.code = code


def _shutdown(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """Close stdin (the child's exit signal), wait, kill if it lingers, reap."""
    if proc.poll() is None:
        try:
            if proc.stdin is not None:
                proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("sandbox pid %d ignored stdin EOF for %.1fs; killing it", proc.pid, grace_s)
            proc.kill()
            proc.wait()
    for stream in (proc.stdin, proc.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass


class PythonSandbox(Resource):
    """A persistent Python namespace in a child process. Op: ``exec(code)``. Queries: ``vars``, ``get``."""

    kind = "python-sandbox"
    recovery = Recovery.RESTART_ONLY

    def __init__(self, resource_id: str, initial_code: str = "", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """``timeout_s``: how long one ``exec`` of the model's code may run before it is stopped
        (and the interpreter started again: see the module doc)."""
        super().__init__(resource_id)
        self._initial_code = initial_code
        self._timeout_s = timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize[[subprocess.Popen[bytes], float], PythonSandbox] | None = None
        self._buffer = bytearray()
        self._start()

    # -- process lifecycle -------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The child's pid while it runs; None once closed."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None

    def _start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env["PYTHONHASHSEED"] = "0"
        proc = subprocess.Popen(
            [sys.executable, "-u", "-s", "-c", _REPL],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            close_fds=True,
        )
        self._proc, self._buffer = proc, bytearray()
        # Reaps the child even if close() is never called (garbage collection or interpreter exit).
        self._finalizer = weakref.finalize(self, _shutdown, proc, _SHUTDOWN_GRACE_S)
        if self._initial_code:
            resp = self._request({"op": "exec", "code": self._initial_code}, max(self._timeout_s, _QUERY_TIMEOUT_S))
            if not resp.get("ok"):
                self.close()
                raise SandboxError(
                    f"sandbox {self.resource_id!r}: initial code failed ({resp.get('error')}); fix the environment's setup code"
                )

    def close(self) -> None:
        """Stop the child (stdin EOF, then kill after a grace period); safe to call twice."""
        if self._finalizer is not None:
            self._finalizer()
        self._proc = None

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self.close()

    # -- protocol ----------------------------------------------------------------
    def _request(self, payload: dict[str, Any], timeout_s: float = _QUERY_TIMEOUT_S) -> dict[str, Any]:
        """Send one request and read its answer. Raises :class:`SandboxCrashedError` if the child is
        gone before the request is sent, :class:`_SandboxExited` if it exits while serving it, and
        :class:`SandboxTimeoutError` (the child killed) after ``timeout_s`` without an answer."""
        proc = self._proc
        if proc is None:
            raise SandboxClosedError(f"sandbox {self.resource_id!r} is closed; reset() it or build a new environment")
        assert proc.stdin is not None and proc.stdout is not None
        code = proc.poll()  # reaps a child that died since the last request: nothing it is sent could have killed it
        try:
            if code is not None:
                raise BrokenPipeError(f"exited with code {code}")
            proc.stdin.write((json.dumps(payload) + "\n").encode("utf-8"))
            proc.stdin.flush()
        except OSError as exc:
            code = proc.poll()
            self.close()
            raise SandboxCrashedError(
                f"sandbox {self.resource_id!r} (pid {proc.pid}) is gone (exit code {code}); restart the rollout"
            ) from exc
        reply: dict[str, Any] = json.loads(self._read_line(proc, timeout_s))  # one JSON object a line
        return reply

    def _read_line(self, proc: subprocess.Popen[bytes], timeout_s: float) -> bytes:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = Deadline(timeout_s)  # for the whole line: a child that dribbles bytes never resets it
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([fd], [], [], deadline.left())
            if not ready:
                self._kill()
                raise SandboxTimeoutError(
                    f"sandbox {self.resource_id!r} (pid {proc.pid}) gave no answer within {timeout_s}s and was killed; restart the rollout"
                )
            chunk = os.read(fd, 65536)
            if not chunk:
                try:  # the pipe closed: the child is exiting, and its exit code says how
                    code = proc.wait(timeout=_SHUTDOWN_GRACE_S)
                except subprocess.TimeoutExpired:  # it closed the protocol's pipe and ran on
                    proc.kill()
                    code = proc.wait()
                self.close()
                raise _SandboxExited(
                    f"sandbox {self.resource_id!r} (pid {proc.pid}) exited (code {code}) mid-request; restart the rollout",
                    code,
                )
            self._buffer += chunk
        line, _, rest = self._buffer.partition(b"\n")
        self._buffer = bytearray(rest)
        return bytes(line)

    # -- resource hooks ----------------------------------------------------------
    def _apply(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op != "exec":
            raise self._unknown(op, ("exec",))
        try:
            resp = self._request({"op": "exec", "code": self._arg(op, args, "code")}, self._timeout_s)
        except SandboxTimeoutError:  # the model's code ran too long (the child is killed): the policy's doing
            return self._started_again(f"Timeout: the code ran longer than {self._timeout_s:g} s")
        except _SandboxExited as exc:  # the model's code ended the interpreter
            return self._started_again(f"Exited: the code ended the interpreter (exit code {exc.code})")
        stdout = resp.get("stdout", "")
        if len(stdout) > MAX_STDOUT_CHARS:
            stdout = stdout[:MAX_STDOUT_CHARS] + f"...[{len(stdout) - MAX_STDOUT_CHARS} chars cut]"
        result: dict[str, Any] = {"ok": bool(resp.get("ok")), "stdout": stdout}
        if "error" in resp:
            result["error"] = resp["error"]
        return result

    def _started_again(self, what: str) -> dict[str, Any]:
        """A fresh interpreter (the task's initial code run) after the model's code stopped the old
        one, and the result that says so."""
        self._start()
        note = f"{what}; the interpreter was started again, its variables are back at the task's start"
        return {"ok": False, "stdout": "", "error": note, "reset": True}

    def _query(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "vars":
            return {"vars": self._request({"op": "vars"})["vars"]}
        if op == "get":
            name = self._arg(op, args, "name")
            return {"name": name, "repr": self._request({"op": "vars"})["vars"].get(name)}
        raise self._unknown(op, ("vars", "get"))

    def _canonical_state(self) -> object:
        return {"vars": self._request({"op": "vars"})["vars"]}

    def _reset(self) -> None:
        self.close()
        self._start()


# ----------------------------------------------------------------- the environment

_STEPS: dict[str, Callable[[int], int]] = {
    "py(x = x + 1)": lambda x: x + 1,
    "py(x = x - 1)": lambda x: x - 1,
    "py(x = x * 2)": lambda x: x * 2,
    "py(x = x // 2)": lambda x: x // 2,
}
_PRINT = "py(print(x))"


class SandboxEnvironment(Environment):
    """Drive ``x`` in a live interpreter to a target value. 6 actions, always the same.

    A dataset row (workload ``tasks``) may set, in its ``task`` object, ``timeout_s`` (how long
    one action's code may run, default 10) and ``actions`` (the code offered as ``py(<code>)``
    actions instead of the arithmetic steps and ``print(x)``; ``submit()`` always follows)."""

    name = "sandbox"
    ACTIONS: ClassVar[tuple[str, ...]] = (*_STEPS, _PRINT, SUBMIT)

    def __init__(self, rollout_id: str, task: Task | int) -> None:
        super().__init__(rollout_id, task)
        rng = random.Random(self.task_seed)
        self.start_value = rng.randint(1, 6)
        x = self.start_value
        for _ in range(rng.randint(2, 4)):
            x = rng.choice((lambda v: v + 1, lambda v: v * 2))(x)
        self.target = x
        timeout_s, self.actions = self._task_settings()
        self.python = PythonSandbox(
            self.resource_id("python"), initial_code=f"x = {self.start_value}", timeout_s=timeout_s
        )
        self._add_resource(self.python)

    def _task_settings(self) -> tuple[float, tuple[str, ...]]:
        """(exec timeout, actions) from the task's fields; ConfigurationError naming the task if wrong."""
        fields, where = self.task.fields, f"sandbox task {self.task.task_id or self.task_seed}"
        timeout_s = fields.get("timeout_s", DEFAULT_TIMEOUT_S)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigurationError(f"{where}: task.timeout_s must be a number of seconds above 0, got {timeout_s!r}")
        code = fields.get("actions")
        if code is None:
            return float(timeout_s), self.ACTIONS
        if not isinstance(code, list) or not code or not all(isinstance(c, str) and c.strip() for c in code):
            raise ConfigurationError(f"{where}: task.actions must be a list of code strings, got {code!r}")
        return float(timeout_s), (*(f"py({c})" for c in code), SUBMIT)

    def task_prompt(self) -> str:
        return f"A Python sandbox holds an integer variable x. Make x equal {self.target}, then call submit()."

    def action_space(self) -> list[str]:
        return list(self.actions)

    def _perform(self, action: str, mutations: StepMutations) -> str:
        code = action[len("py(") : -1]
        result = mutations.apply(self.python, "exec", {"code": code})
        if not result["ok"]:
            return f"{result['stdout']}{result['error']}"
        return result["stdout"].rstrip("\n") or "ok"

    def current_x(self) -> int | None:
        """x as the child holds it, or None if it is not an int."""
        text = self.python.query("get", {"name": "x"})["repr"]
        try:
            return int(text)
        except (TypeError, ValueError):
            return None

    def verify(self) -> float:
        """1 / (1 + |x - target|); 0 if x is not an int."""
        x = self.current_x()
        return 0.0 if x is None else 1.0 / (1.0 + abs(x - self.target))

    @staticmethod
    def step_effect(action: str) -> Callable[[int], int] | None:
        """The arithmetic an action applies to x (None for non-arithmetic actions); for planners and tests."""
        return _STEPS.get(action)
