"""The parent side of the agent's REPL: starts `worker.py` as an isolated child process, sends it
code blocks, serves its tool calls, and kills and restarts it when a block misbehaves.

Isolation (docs/rlmopt.md, Sandbox): `python -I -S` (no environment variables, user site or
site-packages), a scrubbed environment, a fresh temporary directory as cwd and HOME, its own
process group (a timeout kills the whole group with SIGKILL), plus the worker's own lockdown
(rlimits, capabilities, user, Landlock, seccomp; `Repl.holds` says which took effect). `start`
refuses (layers.SandboxRefused, one line) when a layer `layers.promised` on this host is missing,
unless config.sandbox is "best_effort".

A block gets one monotonic wall-clock cap, `block_timeout_s`, that includes the time the parent
spends serving its tool calls. Each exec carries a fresh nonce that its `done` must echo (other
`done` lines, e.g. printed by agent code without it, are ignored), and between blocks the worker
is stopped (SIGSTOP, confirmed by waitpid), so nothing the agent started runs while the parent
is not inside `run`. The nonce is not a secret from code in the worker (it can read its own
frames); the cap and the stop are what bound a block's time whatever it writes. The parent never
blocks on the worker: its writes are non-blocking and wait at most until the block's deadline
(a worker that forges tool calls and never reads their results fills its stdin pipe), and the
deadline is checked before each message is served, buffered ones included.
"""
from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from rlmopt.config import RLMOptConfig
from rlmopt.sandbox import layers

WORKER = Path(__file__).with_name("worker.py")
_START_TIMEOUT_S = 30.0
_MAX_MESSAGE_BYTES = 16 << 20
_MAX_DEPTH = 64  # deepest JSON nesting accepted in a message from the worker


def _too_deep(value: Any) -> bool:
    """Whether `value` nests lists/dicts deeper than _MAX_DEPTH (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth > _MAX_DEPTH:
                return True
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return False


@dataclass
class BlockResult:
    """What one code block did: printed `output`, the traceback `error` (None if it ran
    cleanly), and `killed` (why the worker was killed and restarted, else None)."""

    output: str
    error: str | None = None
    killed: str | None = None


class Repl:
    """A persistent REPL in a sandboxed worker process.

    dispatch(name, args, kwargs) -> JSON-able value serves the worker's tool calls (it runs in the
    calling thread). tools: the names bound in the worker's namespace.
    """

    def __init__(self, dispatch: Callable[[str, list, dict], Any], tools: Sequence[str],
                 config: RLMOptConfig):
        self.dispatch, self.tools, self.config = dispatch, list(tools), config
        self.proc: subprocess.Popen | None = None
        self.dir: str | None = None
        self.holds: dict[str, bool] = {}
        self.lockdown_errors: dict[str, str] = {}
        self.lockdown_info: dict[str, Any] = {}  # landlock_abi (0: none), uid of the worker
        self.restarts = 0
        self.deadline: float | None = None  # time.monotonic() end of the block now running
        self._buf = bytearray()

    # -- process -----------------------------------------------------------------------------------

    def start(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="rlmopt-repl-")
        cfg = {"tools": self.tools, "memory_mb": self.config.worker_memory_mb,
               "cpu_s": self.config.worker_cpu_s, "files": self.config.worker_files,
               "file_mb": self.config.worker_file_mb, "output_cap": 4 * self.config.output_chars}
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": self.dir, "TMPDIR": self.dir}
        self.proc = subprocess.Popen(
            self._command(json.dumps(cfg)), cwd=self.dir, env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
            close_fds=True)
        os.set_blocking(self.proc.stdin.fileno(), False)  # _send waits with the block's deadline
        self._buf = bytearray()
        msg = self._recv(time.monotonic() + _START_TIMEOUT_S)
        if not msg or msg.get("op") != "ready":
            self.close()
            raise RuntimeError("the REPL worker did not start (rlmopt/sandbox/worker.py); run it "
                               "by hand with `python -I -S` to see why")
        self.holds, self.lockdown_errors = msg["holds"], msg.get("errors", {})
        self.lockdown_info = msg.get("info", {})
        why = layers.refusal(self.holds, self.lockdown_errors, root=os.geteuid() == 0,
                             mode=self.config.sandbox)
        if why:  # before any agent code reaches the worker
            self.close()
            raise layers.SandboxRefused(why)

    @staticmethod
    def _command(config_json: str) -> list[str]:
        """The worker's command line: isolated mode, no site-packages."""
        return [sys.executable, "-I", "-S", str(WORKER), config_json]

    def sandbox_report(self) -> dict:
        """The layers in force in the running worker (layers.summary), for record.json and the
        run log."""
        return layers.summary(self.holds, self.lockdown_errors, self.lockdown_info,
                              root=os.geteuid() == 0, mode=self.config.sandbox)

    def close(self) -> None:
        if self.proc is not None:
            self._signal(signal.SIGKILL)  # the whole group, stopped or not
            self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout):
                if stream:
                    stream.close()
            self.proc = None
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def _restart(self) -> None:
        self.close()
        self.restarts += 1
        self.start()

    # -- channel -----------------------------------------------------------------------------------

    def _send(self, msg: dict, deadline: float) -> str | None:
        """Writes one message to the worker without ever blocking past `deadline` (its stdin is
        non-blocking: a worker that stops reading, e.g. after forging tool calls whose results
        fill the pipe, cannot hold the harness). None when written; "timeout"; "closed" (the
        worker's end is gone). Raises TypeError/ValueError for a value that is not JSON."""
        assert self.proc is not None and self.proc.stdin is not None
        data = memoryview((json.dumps(msg) + "\n").encode())
        fd = self.proc.stdin.fileno()
        while data:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            _, ready, _ = select.select([], [fd], [], left)
            if not ready:
                continue
            try:
                data = data[os.write(fd, data):]
            except BlockingIOError:  # the pipe filled between select and write
                continue
            except OSError:
                return "closed"
        return None

    def _recv(self, deadline: float) -> dict | None | str:
        """The next message; None on EOF (the worker died); "timeout" past the deadline; "flood"
        when more than _MAX_MESSAGE_BYTES arrive without a message end."""
        assert self.proc is not None and self.proc.stdout is not None
        if time.monotonic() >= deadline:  # also before a line already buffered
            return "timeout"
        fd = self.proc.stdout.fileno()
        end = self._buf.find(b"\n")
        while end < 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            if b"\n" in chunk:
                end = len(self._buf) + chunk.index(b"\n")
            self._buf += chunk
            if end < 0 and len(self._buf) > _MAX_MESSAGE_BYTES:
                return "flood"
        line = bytes(self._buf[:end])
        del self._buf[:end + 1]
        try:  # anything agent code writes here is untrusted: no exception may leave this
            msg = json.loads(line)
        except (ValueError, RecursionError, MemoryError):
            return {"op": "garbage"}
        return msg if isinstance(msg, dict) and not _too_deep(msg) else {"op": "garbage"}

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        if self.proc.returncode is not None:  # reaped: its pid may already be someone else's
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _freeze(self) -> None:
        """Stops the worker until the next block; returns once the kernel reports it stopped."""
        assert self.proc is not None
        self._signal(signal.SIGSTOP)
        try:
            _, status = os.waitpid(self.proc.pid, os.WUNTRACED)
        except ChildProcessError:
            return
        if not os.WIFSTOPPED(status):  # it exited meanwhile: keep its status for poll()/wait()
            self.proc.returncode = os.waitstatus_to_exitcode(status)

    def _serve_tool(self, msg: dict, deadline: float) -> str | None:
        """Answers one tool call; what `_send` says (None, "timeout" or "closed")."""
        name, args, kwargs = msg.get("name"), msg.get("args", []), msg.get("kwargs", {})
        if not (isinstance(name, str) and isinstance(args, list) and isinstance(kwargs, dict)):
            value: Any = {"error": "a tool call needs a name (str), args (list), kwargs (dict)"}
        else:
            try:
                value = self.dispatch(name, args, kwargs)
            except Exception as exc:  # a harness bug must not kill the agent loop
                value = {"error": f"tool {name} failed: {type(exc).__name__}: {exc}"}
        try:
            return self._send({"op": "result", "id": msg.get("id"), "value": value}, deadline)
        except (TypeError, ValueError, RecursionError) as exc:  # a value that is not JSON
            return self._send({"op": "result", "id": msg.get("id"),
                               "value": {"error": f"tool {name} returned no JSON value ({exc})"}},
                              deadline)

    # -- blocks ------------------------------------------------------------------------------------

    def _killed(self, why: str) -> BlockResult:
        self._restart()
        return BlockResult("", killed=why)

    def run(self, code: str) -> BlockResult:
        """Runs one block; never raises for anything the block does."""
        if self.proc is None or self.proc.poll() is not None:
            self._restart()
        nonce = secrets.token_hex(16)
        timeout = self.config.block_timeout_s
        deadline = time.monotonic() + timeout  # one cap for the block, its tool calls included
        self.deadline = deadline
        over = (f"the block ran past {timeout:g} s (its tool calls included) and the worker was "
                "killed and restarted; REPL variables are lost, the tool calls it made stand "
                "(evaluations are cached)")
        self._signal(signal.SIGCONT)
        sent = self._send({"op": "exec", "code": code, "nonce": nonce}, deadline)
        if sent == "closed":
            return self._killed("the worker had exited; it was restarted, so REPL variables are "
                                "lost. Run the block again.")
        if sent == "timeout":
            return self._killed(over)
        while True:
            msg = self._recv(deadline)
            if msg == "timeout":
                return self._killed(over)
            if msg == "flood":
                return self._killed(f"the block wrote over {_MAX_MESSAGE_BYTES >> 20} MB to the "
                                    "tool channel; the worker was killed and restarted, so REPL "
                                    "variables are lost")
            if msg is None:
                try:  # a worker that closed its channel but runs on is killed by the restart
                    code_ = self.proc.wait(timeout=1.0) if self.proc else None
                except subprocess.TimeoutExpired:
                    code_ = None
                how = ("channel closed" if code_ is None else
                       f"signal {-code_}" if code_ < 0 else f"exit {code_}")
                return self._killed(f"the worker died ({how}, e.g. a resource limit); it was "
                                    "restarted and REPL variables are lost")
            op = msg.get("op")
            if op == "done" and msg.get("nonce") == nonce:
                self._freeze()
                error = msg.get("error")
                return BlockResult(str(msg.get("output", "")),
                                   None if error is None else str(error))
            if op == "tool":
                served = self._serve_tool(msg, deadline)
                if served == "timeout":
                    return self._killed(
                        f"the block ran past {timeout:g} s with tool results it did not read "
                        "(tool-call lines written to the channel by the block's own code?); the "
                        "worker was killed and restarted, so REPL variables are lost")
                # "closed": the next _recv sees the worker's end of the channel gone
            # anything else (garbage or a done without this block's nonce) is ignored


def preflight(config: RLMOptConfig) -> None:
    """Starts a worker and closes it: a sandbox that cannot be put in place as `config.sandbox`
    demands refuses now (layers.SandboxRefused, one line), before a run spends any LM call on the
    seed's validation pass. The agent's own REPL starts afresh afterwards."""
    repl = Repl(lambda name, args, kwargs: None, (), config)
    try:
        repl.start()
    finally:
        repl.close()

