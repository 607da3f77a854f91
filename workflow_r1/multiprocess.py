"""Runs one program as N JAX processes on this machine: a multi-host job without the hosts.

    python -m workflow_r1.multiprocess --num_processes=2 --devices_per_process=2 -- \\
        workflow_r1.train --config=configs/gsspo.py:tiny --workdir=/tmp/tiny2

Every process runs the same command (a module name, or a script path ending in .py, then its
arguments) with the variables a pod launcher sets, which `sharding.maybe_initialize_distributed`
reads:

    JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>   process 0 serves the coordination service
    JAX_NUM_PROCESSES=N, JAX_PROCESS_ID=i           one per process
    XLA_FLAGS=--xla_force_host_platform_device_count=D, JAX_PLATFORMS=cpu

so each process sees D simulated CPU devices locally and N x D devices globally; CPU collectives
go over gloo. Output is merged line by line with a `[pI] ` prefix per process. If any process
fails, or the whole job runs past `--timeout_s`, every process group is killed (the others would
wait for the dead one in their next collective forever). The exit status is the first failing
process's, 124 on timeout.

Tests use `launch` directly (tests/test_multihost.py); a TPU pod runs the same program with the
variables set by its own launcher (docs/multihost.md).
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from absl import app, flags

TIMEOUT_STATUS = 124


@dataclasses.dataclass
class ProcessResult:
    """One process of a job: its id, exit status (-signal if killed by one) and merged output."""

    process_id: int
    returncode: int
    output: str


@dataclasses.dataclass
class JobResult:
    """A finished job. `failed` is the first process that exited non-zero (None: all succeeded)."""

    processes: list[ProcessResult]
    timed_out: bool
    failed: int | None

    @property
    def returncode(self) -> int:
        if self.timed_out:
            return TIMEOUT_STATUS
        return 0 if self.failed is None else (self.processes[self.failed].returncode or 1)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def output(self) -> str:
        """Every process's output, one block per process, each line prefixed `[pI] `."""
        return "\n".join(p.output for p in self.processes)

    def describe(self) -> str:
        """One line naming what went wrong (or "ok"), for an error message."""
        if self.timed_out:
            return "timed out; every process was killed"
        if self.failed is None:
            return "ok"
        return f"process {self.failed} exited with status {self.processes[self.failed].returncode}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(process_id: int, num_processes: int, devices_per_process: int, port: int,
                base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of process `process_id`: `base` (default os.environ) plus the job's variables."""
    env = dict(os.environ if base is None else base)
    env.update({
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(num_processes),
        "JAX_PROCESS_ID": str(process_id), "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_process}",
        "PYTHONUNBUFFERED": "1"})
    if any(env.get(k) for k in ("http_proxy", "https_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY")):
        # The coordination service is local: never route its gRPC through a proxy.
        for key in ("no_proxy", "NO_PROXY"):
            env[key] = ",".join(filter(None, (env.get(key), "127.0.0.1,localhost")))
    if num_processes == 1:  # one process: no coordinator (the same program, not distributed)
        for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
            env.pop(key)
    return env


def command(program: Sequence[str]) -> list[str]:
    """The Python command line of `program`: [module, args...] or [script.py, args...]."""
    if not program:
        raise ValueError("no program to run; pass a module (or a .py script) and its arguments after --")
    head, *rest = program
    return [sys.executable, head, *rest] if head.endswith(".py") else [sys.executable, "-m", head, *rest]


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of `proc` (the process and whatever it started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def launch(program: Sequence[str], *, num_processes: int = 2, devices_per_process: int = 2,
           timeout_s: float = 300.0, cwd: str | pathlib.Path | None = None,
           env: Mapping[str, str] | None = None, echo: bool = False) -> JobResult:
    """Runs `program` as `num_processes` processes of `devices_per_process` CPU devices each; waits.

    Args:
      program: [module or script.py, args...], the same for every process.
      timeout_s: wall-clock limit for the whole job; past it every process is killed.
      cwd: working directory of the processes (default: this one).
      env: base environment (default: os.environ); the job's variables are set on top.
      echo: also print each output line (prefixed) as it arrives.

    Returns a `JobResult`; it never raises for a failing program (read `.ok` / `.describe()`).
    """
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError(f"num_processes={num_processes} and devices_per_process={devices_per_process} must be >= 1")
    argv = command(program)
    port = free_port()
    base = dict(os.environ if env is None else env)
    # A script imports the package from the working directory too, as `python -m` does.
    workdir = str(pathlib.Path(cwd or os.getcwd()).absolute())
    base["PYTHONPATH"] = os.pathsep.join(filter(None, (workdir, base.get("PYTHONPATH"))))
    procs: list[subprocess.Popen] = []
    outputs: list[list[str]] = [[] for _ in range(num_processes)]
    readers = []

    def read(i: int, stream) -> None:
        for line in stream:
            line = f"[p{i}] {line.rstrip()}"
            outputs[i].append(line)
            if echo:
                print(line, flush=True)

    try:
        for i in range(num_processes):
            # A session per process: killing its group also ends anything it started (e.g. a server).
            proc = subprocess.Popen(argv, cwd=cwd, env=process_env(i, num_processes, devices_per_process, port, base),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace", start_new_session=True)
            procs.append(proc)
            t = threading.Thread(target=read, args=(i, proc.stdout), daemon=True)
            t.start()
            readers.append(t)
        deadline = time.monotonic() + timeout_s
        failed, timed_out = None, False
        while True:
            codes = [p.poll() for p in procs]
            failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None or all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_group(p)
        for p in procs:
            p.wait()
        for t in readers:
            t.join(timeout=10)
    return JobResult(processes=[ProcessResult(i, p.returncode, "\n".join(outputs[i])) for i, p in enumerate(procs)],
                     timed_out=timed_out, failed=failed)


_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "JAX processes (simulated hosts)")
_DEVICES = flags.DEFINE_integer("devices_per_process", 2, "simulated CPU devices per process")
_TIMEOUT = flags.DEFINE_float("timeout_s", 3600.0, "kill every process after this many seconds")


def main(argv: list[str]) -> None:
    program = argv[1:]
    if not program:
        raise app.UsageError("pass the program after --, e.g. -- workflow_r1.train --config=configs/gsspo.py:tiny")
    result = launch(program, num_processes=_NUM_PROCESSES.value, devices_per_process=_DEVICES.value,
                    timeout_s=_TIMEOUT.value, echo=True)
    if not result.ok:
        print(f"workflow_r1.multiprocess: {result.describe()}", file=sys.stderr, flush=True)
    sys.exit(result.returncode)


if __name__ == "__main__":
    app.run(main)
