"""Which layers of the REPL sandbox are promised on this host, and whether a worker's lockdown
report keeps the promise (docs/rlmopt.md, Sandbox).

The worker (`worker.py`) reports each layer it tried as holding or not: `holds` {layer: bool} and
`errors` {layer: what failed}. Promised, in the default `strict` mode, are all of `LAYERS` but
`user` when the harness is not root: a non-root harness has no other user to become (its worker
already runs without privileges, and Landlock keeps it out of that user's files). A strict REPL
refuses to run agent code while a promised layer is missing; `best_effort` (the explicit opt-in
for hosts that cannot provide one, e.g. no Landlock in the kernel or no libseccomp) runs with what
holds, and the report of `summary` says what that is.
"""
from __future__ import annotations

from typing import Mapping

LAYERS = ("rlimits", "capabilities", "user", "landlock", "seccomp")
MODES = ("strict", "best_effort")


class SandboxRefused(RuntimeError):
    """A strict REPL's worker lacks a promised layer; the message is one line naming it."""


def promised(root: bool) -> tuple[str, ...]:
    """The layers a strict REPL requires of a harness running as root (`root`) or not."""
    return tuple(layer for layer in LAYERS if root or layer != "user")


def refusal(holds: Mapping[str, bool], errors: Mapping[str, str], *, root: bool,
            mode: str) -> str | None:
    """One line naming every promised layer that `holds` lacks (a layer the report leaves out
    counts as lacking) and the opt-in; None when agent code may run (or `mode` is best_effort)."""
    if mode not in MODES:
        raise ValueError(f"sandbox mode {mode!r}; use one of {', '.join(MODES)}")
    gone = [layer for layer in promised(root) if holds.get(layer) is not True]
    if mode == "best_effort" or not gone:
        return None
    what = "; ".join(f"{layer} ({errors.get(layer) or 'not reported'})" for layer in gone)
    return (f"the REPL sandbox lacks promised layer(s) {what}: run where they hold "
            "(docs/rlmopt.md, Sandbox) or accept a weaker sandbox with --sandbox=best_effort "
            "(config.sandbox)")


def summary(holds: Mapping[str, bool], errors: Mapping[str, str], info: Mapping, *, root: bool,
            mode: str) -> dict:
    """What record.json and the run log keep: {mode, promised, in_force, missing: {layer: why},
    landlock_abi, worker_uid}; `missing` lists every layer not in force, promised or not."""
    return {"mode": mode, "promised": list(promised(root)),
            "in_force": [layer for layer in LAYERS if holds.get(layer) is True],
            "missing": {layer: errors.get(layer) or "not reported"
                        for layer in LAYERS if holds.get(layer) is not True},
            "landlock_abi": info.get("landlock_abi", 0), "worker_uid": info.get("uid")}


def log_line(report: Mapping) -> str:
    """One line for the run log: the layers in force and, if any, those missing."""
    line = f"sandbox ({report['mode']}): in force {', '.join(report['in_force']) or 'none'}"
    if report["missing"]:
        line += "; missing " + "; ".join(f"{k} ({v})" for k, v in report["missing"].items())
    return line
