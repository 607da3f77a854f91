"""Executor load test: calls/s and latency percentiles with the instant fake LLM backend.

    .venv/bin/python benchmarks/executor_load.py [--clients 1 64 512] [--seconds 3] [--loop uvloop]

The server runs as a separate process (`python -m workflow_r1.executor --llm fake --search none`
on 127.0.0.1, a free port), so the load generator and the server do not share an event loop.
For each concurrency level N, N closed-loop clients (coroutines sharing one ExecutorClient, as the
rollout engine does) send calls back to back for `--seconds` after a short warm-up; the run also
stops after `--max-calls` calls. Latency is measured by the client, end to end over HTTP.
Target (issue): >= 2000 calls/s at 64 clients on 2 cores, p99 < 50 ms.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from workflow_r1.executor.__main__ import new_event_loop  # noqa: E402
from workflow_r1.executor.client import ExecutorClient  # noqa: E402


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (Linux /proc), to report CPU cost per call."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "workflow_r1.executor", "--host", "127.0.0.1", "--port", "0",
           "--llm", "fake", "--search", "none", *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if "listening on " in line:
            return proc, line.split("listening on ")[1].split()[0]
    proc.kill()
    raise RuntimeError("executor server did not start; run the command by hand: " + " ".join(cmd))


async def run_level(url: str, clients: int, seconds: float, max_calls: int, operator: str,
                    warmup_s: float, server_pid: int | None) -> dict:
    client = ExecutorClient(url, timeout_s=30.0, max_concurrency=max(clients, 1))
    latencies: list[float] = []
    errors = 0
    stop_at = 0.0
    measuring = False

    async def worker(i: int) -> None:
        nonlocal errors
        n = 0
        while True:
            now = time.perf_counter()
            if stop_at and now >= stop_at:
                return
            if measuring and len(latencies) >= max_calls:
                return
            start = time.perf_counter()
            obs = await client.execute(operator, f"load test question {i}-{n}: what is {n} + {i}?")
            if measuring:
                latencies.append((time.perf_counter() - start) * 1000.0)
                errors += obs.error_kind is not None
            n += 1

    tasks = [asyncio.create_task(worker(i)) for i in range(clients)]
    await asyncio.sleep(warmup_s)
    measuring = True
    cpu_client0 = time.process_time()
    cpu_server0 = process_cpu_s(server_pid) if server_pid else float("nan")
    t0 = time.perf_counter()
    stop_at = t0 + seconds
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    cpu_client = time.process_time() - cpu_client0
    cpu_server = (process_cpu_s(server_pid) if server_pid else float("nan")) - cpu_server0
    await client.aclose()
    lat = np.asarray(latencies)
    return {"clients": clients, "calls": len(lat), "errors": errors,
            "calls_per_s": len(lat) / elapsed, "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "max_ms": float(lat.max()),
            "server_cpu_us": 1e6 * cpu_server / max(len(lat), 1),
            "client_cpu_us": 1e6 * cpu_client / max(len(lat), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 64, 512])
    ap.add_argument("--seconds", type=float, default=3.0, help="measured time per level")
    ap.add_argument("--warmup-s", type=float, default=0.5)
    ap.add_argument("--max-calls", type=int, default=200_000, help="cap on measured calls per level")
    ap.add_argument("--operator", default="AnswerGenerate")
    ap.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                    help="event loop of the server and of the load generator")
    ap.add_argument("--url", default="", help="benchmark a running executor instead of starting one")
    args = ap.parse_args()

    proc = None
    url = args.url
    if not url:
        proc, url = start_server(["--loop", args.loop])
    print(f"executor {url}  operator={args.operator}  loop={args.loop}  cpus={os.cpu_count()}  "
          f"python={sys.version.split()[0]}", flush=True)
    rows = []
    try:
        for n in args.clients:
            with asyncio.Runner(loop_factory=lambda: new_event_loop(args.loop)) as runner:
                row = runner.run(run_level(url, n, args.seconds, args.max_calls, args.operator,
                                           args.warmup_s, proc.pid if proc else None))
            rows.append(row)
            print(f"  {n} clients: {row['calls_per_s']:.0f} calls/s", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    print()
    print(f"| {'clients':>7} | {'calls':>7} | {'errors':>6} | {'calls/s':>8} | {'p50 ms':>7} | "
          f"{'p99 ms':>7} | {'max ms':>7} | {'server CPU us/call':>18} | {'client CPU us/call':>18} |")
    print(f"|{'-' * 9}|{'-' * 9}|{'-' * 8}|{'-' * 10}|{'-' * 9}|{'-' * 9}|{'-' * 9}|{'-' * 20}|{'-' * 20}|")
    for r in rows:
        print(f"| {r['clients']:>7} | {r['calls']:>7} | {r['errors']:>6} | {r['calls_per_s']:>8.0f} | "
              f"{r['p50_ms']:>7.2f} | {r['p99_ms']:>7.2f} | {r['max_ms']:>7.2f} | "
              f"{r['server_cpu_us']:>18.0f} | {r['client_cpu_us']:>18.0f} |")
    print(f"\nload average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus "
          "(other processes share these cores; CPU us/call is the load-independent cost)")


if __name__ == "__main__":
    main()
