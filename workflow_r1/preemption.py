"""A preemption notice (SIGTERM) turned into a decision the trainer takes at its safe points.

A preemptible TPU slice (or a Kubernetes pod, or `kill`) gets SIGTERM some seconds before it is
stopped. `Watch` records the notice; the trainer asks at two kinds of safe point, the same ones on
every host (trainer.py, docs/replicate.md "Preemptible (spot) slices"):

- `requested()`: this host has had the notice (no collective: asked between the rollout's rounds,
  where a host may stop rolling out early);
- `reached()`: the run stops here. A collective: every host calls it at the same program points,
  and they all get the same answer.

Where the notice comes from:

- one process, or several without JAX's preemption service: a Python SIGTERM handler sets a flag;
  with several processes `reached()` is true when any host's flag is set (one small allgather).
  A second SIGTERM ends the process at once (the default action is restored by the first).
- several processes under `jax.distributed` with its preemption service (the default): JAX's own
  notifier holds SIGTERM on every host and the coordination service tells every host; `reached()`
  is orbax's `multihost.reached_preemption` (`jax.experimental.multihost_utils.
  reached_preemption_sync_point`, as MaxText and Tunix call it). `requested()` is then always False:
  the notice is not visible to this process before a sync point.
"""
from __future__ import annotations

import signal
import threading
from typing import Any

import jax


def jax_service_running() -> bool:
    """True when `jax.distributed` runs its preemption sync manager (multi-process, service enabled)."""
    from jax._src import distributed

    return jax.process_count() > 1 and distributed.global_state.preemption_sync_manager is not None


class Watch:
    """`with Watch() as w:` SIGTERM sets `w.signal`; the previous handler comes back on exit.

    Outside the main thread (no Python signal handler can be installed there) and under JAX's
    preemption service it installs nothing."""

    def __init__(self) -> None:
        self.jax_service = jax_service_running()
        self.signal: int | None = None  # the signal received (signal.SIGTERM), None before any
        self._calls = 0  # reached() calls: the sync-point id, equal on every host at the same point
        self._installed, self._previous = False, None

    def __enter__(self) -> "Watch":
        if not self.jax_service and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._installed:  # None: a handler not set from Python, e.g. JAX's; restored as the default
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)
            self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signum
        signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM is not a notice: it ends the process

    def requested(self) -> bool:
        """This host has had a notice (local; never under JAX's service)."""
        return self.signal is not None

    def reached(self) -> bool:
        """Whether the run stops at this safe point; every host must call it at the same points."""
        self._calls += 1
        if self.jax_service:
            import orbax.checkpoint as ocp

            return bool(ocp.multihost.reached_preemption(self._calls))
        if jax.process_count() == 1:
            return self.requested()
        from workflow_r1 import sharding

        return any(sharding.allgather_objects(self.requested()))

    def name(self) -> str:
        """The notice in words: 'SIGTERM', or 'a preemption notice' under JAX's service."""
        return signal.Signals(self.signal).name if self.signal is not None else "a preemption notice"


def stop_line(notice: str, step: int, saved: int, directory: Any) -> str:
    """The line a preempted run ends with: the notice came during `step`; `saved` is the newest step
    on disk (`step`: it was finished; `step` - 1: its rollout was abandoned; 0: nothing is saved)."""
    done = ("finished it and saved it" if saved == step else
            f"abandoned its rollout; step {saved} is saved" if saved else "abandoned its rollout; nothing to save yet")
    return (f"preempted: {notice} during step {step}; {done}" + f" in {directory}" * bool(saved)
            + f"; rerun the same command to resume at step {saved + 1}")


class Preempted(Exception):
    """Raised inside a step's rollout when the run stops there (`Watch.reached`); the trainer catches it."""
