"""RLMOptConfig: every knob of a run, with the defaults of docs/rlmopt.md (Defaults)."""
from __future__ import annotations

from dataclasses import dataclass

from workflow_r1 import bounds

# The settings that depend on `style` (docs/rlmopt.md, Styles): a field left at None takes its
# style's value. thorough: the agent may stop on its own once 80% of the budget is used; lean:
# once 25% is (the paper's two floors). The skill prompt's working advice also follows the style.
STYLES: dict[str, dict[str, float]] = {
    "thorough": {"self_stop_floor_pct": 0.80},
    "lean": {"self_stop_floor_pct": 0.25},
}


@dataclass
class RLMOptConfig:
    """Harness, agent and sandbox settings.

    budget: rollouts the agent may spend, one rollout = one task-LM call on one validation example
        (the seed evaluation, polish and test passes are not charged).
    seed: shuffles the train/val/test split and the run_candidate subsample order.
    commit_policy: "no_field_regression" (the per-field floor is always on) or
        "allow_field_regression" (the floor is on only for validation sets of at most
        `small_dataset_records` records).
    field_floor: the largest per-field drop a commit may make against the running best.
    significance_k: a commit's paired gain must exceed this many paired standard errors.
    noise_band_k: the diagnose gate's band, in standard errors of the running best.
    max_candidate_chars, min_rationale_words: the length and rationale guards of commit_prompt.
    polish_variants: run the polish stage; polish_demos: demo counts of the demo variants.
    optimizer_max_iterations: hard cap on agent turns (REPL round trips).
    style: "thorough" or "lean", the agent's working style; the settings in STYLES follow it
        unless set explicitly (`styled` reads them).
    self_stop_floor_pct: the share of the budget after which the skill prompt lets the agent stop
        on its own (None: the style's); self_stop_target: the per-field score at which it may
        stop; self_stop_min_gain: the composite gain below which two tries in a row let it stop.
    stop_rule: "prompt" (the skill prompt asks the agent to stop; the paper's practice), "paper"
        (the harness enforces the paper's three conditions), "calibrated" (the harness stops
        when no commit can clear the gates any more) or "ucb" (calibrated, plus a stop when the
        upper confidence bound of the improvement the budget left can buy is below what a commit
        must gain); rlmopt/stopping.py.
    subagent_max_depth: how deep call_subagent may nest (the agent is depth 0; a child at this
        depth cannot start another); subagent_max_iterations: a child agent's turn cap.
    output_chars: how much of a block's printed output returns to the agent.
    block_timeout_s: wall clock one code block may run, seconds, its tool calls included.
    worker_memory_mb, worker_cpu_s, worker_files, worker_file_mb: the REPL worker's rlimits.
    sandbox: "strict" (the REPL refuses to run agent code when a sandbox layer promised on this
        host is missing; rlmopt/sandbox/layers.py) or "best_effort" (it runs with the layers that
        hold, and record.json says which).
    task_concurrency: task-LM calls in flight during an evaluation.
    gepa_budget: the GEPA baseline's metric-call limit, "matched" (budget + one validation pass)
        or "light" (GEPA's native auto="light" formula); gepa_minibatch: its reflection minibatch.
    """

    budget: int = 30
    seed: int = 7
    commit_policy: str = "no_field_regression"
    field_floor: float = 0.05
    small_dataset_records: int = 20
    significance_k: float = 1.65
    noise_band_k: float = 1.5
    max_candidate_chars: int = 20000
    min_rationale_words: int = 5
    polish_variants: bool = True
    polish_demos: tuple[int, ...] = (3, 8, 15)
    optimizer_max_iterations: int = 40
    optimizer_max_tokens: int = 2048
    style: str = "thorough"
    self_stop_floor_pct: float | None = None
    self_stop_target: float = 0.85
    self_stop_min_gain: float = 0.02
    stop_rule: str = "prompt"
    subagent_max_depth: int = 2
    subagent_max_iterations: int = 8
    output_chars: int = 15000
    block_timeout_s: float = 60.0
    worker_memory_mb: int = 1024
    worker_cpu_s: int = 600
    worker_files: int = 64
    worker_file_mb: int = 64
    sandbox: str = "strict"
    task_concurrency: int = 32
    gepa_budget: str = "matched"
    gepa_minibatch: int = 3

    def __post_init__(self) -> None:
        if self.commit_policy not in ("no_field_regression", "allow_field_regression"):
            raise ValueError(f"commit_policy {self.commit_policy!r}; use no_field_regression or "
                             "allow_field_regression")
        if self.gepa_budget not in ("matched", "light"):
            raise ValueError(f"gepa_budget {self.gepa_budget!r}; use matched or light")
        if self.style not in STYLES:
            raise ValueError(f"style {self.style!r}; use one of {sorted(STYLES)}")
        if self.stop_rule not in ("prompt", "paper", "calibrated", "ucb"):
            raise ValueError(f"stop_rule {self.stop_rule!r}; use prompt, paper, calibrated or ucb")
        bounds.check("self_stop_floor_pct", self.self_stop_floor_pct, 0, 1, optional=True,
                     note=" (a share of the budget; None: the style's)")
        if self.sandbox not in ("strict", "best_effort"):
            raise ValueError(f"sandbox {self.sandbox!r}; use strict or best_effort")
        c = bounds.check
        for key, low, high, note in (
                ("budget", 0, bounds.MAX_COUNT, ""), ("seed", 0, 2**32 - 1, ""),
                ("small_dataset_records", 0, bounds.MAX_COUNT, ""), ("max_candidate_chars", 1, 1 << 24, ""),
                ("min_rationale_words", 0, 10_000, ""), ("optimizer_max_iterations", 1, 100_000, ""),
                ("optimizer_max_tokens", 1, bounds.MAX_TOKENS, ""),
                ("subagent_max_depth", 0, 16, " (0: no sub-agents)"), ("subagent_max_iterations", 1, 100_000, ""),
                ("output_chars", 1, 1 << 24, ""),
                # A block under a second cannot start its tool calls; 0 or less killed every block.
                ("block_timeout_s", 1, 86_400, " (seconds a code block may run)"),
                # The worker's address space must hold Python and its libraries (libseccomp included):
                # below a few hundred MB the sandbox fails to load and the cause reads as a missing library.
                ("worker_memory_mb", 256, 1 << 22, " (the REPL worker's address space, MB)"),
                ("worker_cpu_s", 1, 1 << 24, " (the REPL worker's CPU seconds)"),
                ("worker_files", 16, 1 << 20, " (the REPL worker's open files)"),
                ("worker_file_mb", 1, 1 << 22, ""), ("task_concurrency", 1, 1 << 16, ""),
                ("gepa_minibatch", 1, bounds.MAX_COUNT, "")):
            c(key, getattr(self, key), low, high, note=note)
        for key, high in (("field_floor", 1), ("significance_k", 100), ("noise_band_k", 100),
                          ("self_stop_target", 1), ("self_stop_min_gain", 1)):
            c(key, getattr(self, key), 0, high)
        for n in self.polish_demos:
            c("polish_demos[i]", n, 0, bounds.MAX_COUNT)


    def styled(self, name: str) -> float:
        """A style-dependent setting: the field's value if set, else the style's (STYLES)."""
        value = getattr(self, name)
        return STYLES[self.style][name] if value is None else value


def config_dict() -> "ml_collections.ConfigDict":
    """RLMOptConfig as an ml_collections ConfigDict (configs/rlmopt.py; `--config.KEY=VALUE` of
    rlmopt.run). Tuple fields stay tuples, the form config_flags can override ('(3, 8)')."""
    import ml_collections

    from workflow_r1 import configlib

    values = configlib.section(RLMOptConfig).to_dict()
    values["polish_demos"] = tuple(values["polish_demos"])
    return ml_collections.ConfigDict(values)


def define_config_flag(argv: list[str]) -> None:
    """Defines --config (every RLMOptConfig field) for an entry point (rlmopt.run, rlmopt.compare).
    config_flags applies the --config.KEY overrides while defining the flag, so unknown keys are
    checked first, for a one-line error."""
    from ml_collections import config_flags

    from workflow_r1 import configlib

    keys = [a.split("=", 1)[0].split(".", 1)[1] for a in argv if a.startswith("--config.")]
    try:
        configlib.check_keys(config_dict(), keys)
    except configlib.ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
    config_flags.DEFINE_config_dict("config", config_dict(),
                                    "rlmopt settings (RLMOptConfig); override as --config.KEY=VALUE")
