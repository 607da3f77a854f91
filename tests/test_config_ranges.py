"""Every config value is range-checked when the config is read: NaN, inf, a negative count or an
absurd budget is one line naming the key and its range, through the same `--config.key=value`
parsing as the command line; every preset still builds."""

import os
import pathlib
import subprocess
import sys

import pytest

from workflow_r1 import bounds, configlib, run_config

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
ROOT = CONFIGS.parent

# override -> the start of its one-line error (after "config key " / "config: ").
BAD = [
    ("train.learning_rate=nan", "train.learning_rate must be in (0, 1], got nan"),
    ("train.learning_rate=inf", "train.learning_rate must be in (0, 1], got inf"),
    ("train.learning_rate=-1e-6", "train.learning_rate must be in (0, 1], got -1e-06"),
    ("train.learning_rate=0", "train.learning_rate must be in (0, 1], got 0.0"),
    ("train.weight_decay=nan", "train.weight_decay must be in [0, 10], got nan"),
    ("train.adam_b1=1.5", "train.adam_b1 must be in [0, 0.9999], got 1.5"),
    ("train.adam_b2=-inf", "train.adam_b2 must be in [0, 0.9999999], got -inf"),
    ("train.adam_eps=0", "train.adam_eps must be in (0, 1], got 0.0"),
    # An optional field reads "nan" as a string (the override is a Python literal there): refused too.
    ("train.max_grad_norm=nan", "train.max_grad_norm='nan' must be float or None"),
    ("train.max_grad_norm=-1", "train.max_grad_norm must be in (0, 1000000] or None (None: no clipping), got -1.0"),
    ("train.clip_eps_low=-0.2", "train.clip_eps_low must be in (0, 1], got -0.2"),
    ("train.clip_eps_high=nan", "train.clip_eps_high must be in (0, 100], got nan"),
    ("train.dual_clip_c=0.5", "train.dual_clip_c must be in (1, 1000000] or None (None: off), got 0.5"),
    ("train.kl_coef=-0.001", "train.kl_coef must be in [0, 1000] (0: no KL term), got -0.001"),
    ("train.tis_cap=0", "train.tis_cap must be in (0, 1000000] or None (None: no correction), got 0"),
    ("train.entropy_coef=nan", "train.entropy_coef must be in [0, 1000] (0: no entropy term), got nan"),
    ("train.num_mini_batches=0", "train.num_mini_batches must be in [1, 16777216], got 0"),
    ("train.micro_batch_size=-4", "train.micro_batch_size must be in [1, 16777216] or None, got -4"),
    ("train.logprob_chunk_size=0", "train.logprob_chunk_size must be in [1, 1048576] or None, got 0"),
    ("train.logprob_unchunked_max_mb=-1", "train.logprob_unchunked_max_mb must be in [0, 1073741824]"),
    ("train.warmup_steps=-1", "train.warmup_steps must be in [0, 16777216] (0: none), got -1"),
    ("train.refill_rounds=-1", "train.refill_rounds must be in [0, 1000] (0: off), got -1"),
    ("train.grad_diagnostics_every=-1", "train.grad_diagnostics_every must be in [0, 16777216] (0: off), got -1"),
    ("train.pack_tokens=-1", "train.pack_tokens must be in [0, 1048576] (0: no packing), got -1"),
    ("train.max_staleness=-1", "train.max_staleness must be in [0, 1000] (0: synchronous), got -1"),
    ("train.max_staleness=1001", "train.max_staleness must be in [0, 1000] (0: synchronous), got 1001"),
    ("train.behaviour_weight_cap=0", "train.behaviour_weight_cap must be in (0, 1000000], got 0.0"),
    ("train.behaviour_weight_cap=nan", "train.behaviour_weight_cap must be in (0, 1000000], got nan"),
    # rollout.temperature is train.temperature's reference: the train section reads it first.
    ("rollout.temperature=nan", "train.temperature must be in (0, 100], got nan"),
    ("rollout.top_p=0", "rollout.top_p must be in (0, 1], got 0.0"),
    ("rollout.top_p=nan", "rollout.top_p must be in (0, 1], got nan"),
    ("rollout.top_k=-1", "rollout.top_k must be in [0, 16777216] (0: off), got -1"),
    ("rollout.prompts_per_step=0", "rollout.prompts_per_step must be in [1, 16777216], got 0"),
    ("rollout.n=-8", "rollout.n must be in [1, 65536], got -8"),
    ("rollout.max_response_tokens=2000000000", "rollout.max_response_tokens must be in [1, 1048576], got 2000000000"),
    ("rollout.max_prompt_tokens=1048000",
     "rollout.max_prompt_tokens + rollout.max_response_tokens must be in [2, 1048576], got 1049024"),
    ("rollout.max_turn_tokens=-1", "rollout.max_turn_tokens must be in [0, 1048576] (0: only the response budget)"),
    ("rollout.max_assistant_turns=0", "rollout.max_assistant_turns must be in [1, 65536], got 0"),
    ("rollout.max_observation_chars=-1", "rollout.max_observation_chars must be in [0, 1073741824], got -1"),
    ("rollout.pad_multiple=0", "rollout.pad_multiple must be in [1, 1048576], got 0"),
    ("rollout.max_rows_in_flight=-1", "rollout.max_rows_in_flight must be in [0, 16777216] (0: every row of the host)"),
    ("rollout.page_size=0", "rollout.page_size must be in [1, 65536], got 0"),
    ("rollout.kv_cache_pages=-1", "rollout.kv_cache_pages must be in [0, 16777216] (0: enough for every row"),
    ("rollout.decode_burst=0", "rollout.decode_burst must be in [1, 1048576], got 0"),
    ("eval.max_questions=-1", "eval.max_questions must be in [0, 16777216] (0: all), got -1"),
    ("eval.batch_size=-5", "eval.batch_size must be in [1, 65536], got -5"),
    ("eval.every_steps=-1", "eval.every_steps must be in [0, 16777216] (0: only after the last step), got -1"),
    ("data.eval_holdout=-1", "data.eval_holdout must be in [0, 16777216] (0: none), got -1"),
    ("data.max_questions=100000000", "data.max_questions must be in [0, 16777216] (0: all), got 100000000"),
    ("checkpoint.every_steps=100000000", "checkpoint.every_steps must be in [0, 16777216] (0: only at the end)"),
    ("checkpoint.keep=100000", "checkpoint.keep must be in [1, 1000], got 100000"),
    ("executor.timeout_s=nan", "executor.timeout_s must be in (0, 604800] seconds, got nan"),
    ("executor.timeout_s=0", "executor.timeout_s must be in (0, 604800] seconds, got 0.0"),
    ("executor.max_concurrency=0", "executor.max_concurrency must be in [1, 65536], got 0"),
    ("executor.max_tokens=-1", "executor.max_tokens must be in [1, 1048576], got -1"),
    ("executor.max_attempts=0", "executor.max_attempts must be in [1, 100], got 0"),
    ("executor.search_topk=0", "executor.search_topk must be in [1, 1000], got 0"),
    ("executor.search_snippet_chars=-1", "executor.search_snippet_chars must be in [0, 1048576] (0: full text)"),
    ("executor.local_max_batch=0", "executor.local_max_batch must be in [1, 65536], got 0"),
    ("model.lora_alpha=nan", "model.lora_alpha must be in (0, 1000000], got nan"),
    ("model.lora_rank=-1", "model.lora_rank must be in [0, 65536] (0: full fine-tuning), got -1"),
    ("model.seed=-1", "model.seed must be in [0, 4294967295], got -1"),
    ("env.max_operator_calls=0", "env.max_operator_calls must be in [1, 1000], got 0"),
    ("seed=-3", "seed must be in [0, 4294967295], got -3"),
    ("steps=100000000", "steps must be in [0, 16777216], got 100000000"),
    ("epochs=100000", "epochs must be in [1, 65536], got 100000"),
]


@pytest.mark.parametrize("override,message", BAD, ids=[o for o, _ in BAD])
def test_a_bad_value_is_one_line_naming_the_key_and_range(override, message):
    with pytest.raises(configlib.ConfigError) as e:
        run_config.Run.from_config(configlib.load(f"{CONFIGS}/gsspo.py:tiny", [override, "mesh.tensor=2"]))
    line = str(e.value)
    prefix = "config: " if "." not in override.partition("=")[0] else "config key "
    assert line.startswith(prefix + message) and "\n" not in line, line


def test_optional_fields_refuse_nan_and_inf_as_values_too():
    """A NaN that reaches an optional field as a float (a config file, a sweep) is refused in range terms."""
    from workflow_r1.rl.train_state import TrainConfig

    for key in ("max_grad_norm", "tis_cap", "dual_clip_c"):
        for bad in (float("nan"), float("inf")):
            with pytest.raises(ValueError, match=rf"^train.{key} must be in \(1?0?, 1000000\] or None .*, got {bad}$"):
                TrainConfig(**{key: bad})


def test_max_staleness_refuses_tis_and_refills_in_one_line():
    """Stale batches carry the behaviour weight, which replaces TIS; refills roll out synchronously."""
    base = ["mesh.tensor=2", "train.max_staleness=2"]
    for extra, message in ((["train.tis_cap=2.0"], "set train.tis_cap=None"),
                           (["train.filter_groups=True", "train.refill_rounds=1"],
                            "set train.refill_rounds=0 or train.max_staleness=0")):
        with pytest.raises(configlib.ConfigError) as e:
            run_config.Run.from_config(configlib.load(f"{CONFIGS}/gsspo.py:tiny", [*base, *extra]))
        line = str(e.value)
        assert line.endswith(message) and "\n" not in line, line
    run = run_config.Run.from_config(configlib.load(f"{CONFIGS}/gsspo.py:tiny", base))
    assert run.train.max_staleness == 2 and run.train.behaviour_weight_cap == 2.0


def test_partial_rollouts_need_a_staleness_in_one_line():
    with pytest.raises(configlib.ConfigError) as e:
        run_config.Run.from_config(configlib.load(f"{CONFIGS}/gsspo.py:tiny", ["mesh.tensor=2",
                                                                             "train.partial_rollouts=True"]))
    line = str(e.value)
    assert line.endswith("set train.max_staleness >= 1 or train.partial_rollouts=False") and "\n" not in line, line


def test_the_edges_of_each_range_are_accepted():
    """The ranges refuse only the absurd: each edge value a run may mean still builds."""
    edges = ["train.learning_rate=1", "train.kl_coef=0", "train.max_grad_norm=None", "train.dual_clip_c=None",
             "rollout.top_p=1", "rollout.top_k=0", "rollout.max_turn_tokens=0", "rollout.max_response_tokens=1044480",
             "eval.max_questions=0", "executor.timeout_s=604800", "model.seed=0", "seed=4294967295"]
    run = run_config.Run.from_config(configlib.load(f"{CONFIGS}/gsspo.py:tiny", [*edges, "mesh.tensor=2"]))
    assert run.rollout.cache_size == bounds.MAX_TOKENS and run.train.learning_rate == 1.0


@pytest.mark.parametrize("name", ["gsspo", "grpo", "gspo"])
@pytest.mark.parametrize("preset", ["paper", "local", "tiny", "operators", "local,tight"])
def test_every_preset_builds(name, preset):
    if name == "grpo" and "tight" in preset:
        pytest.skip("tight is for sequence-level ratios only")
    needs = ["executor.url=http://executor:8000", "data.train_files=train.jsonl"] if preset == "paper" else []
    run = run_config.Run.from_config(configlib.load(f"{CONFIGS}/{name}.py:{preset}", [*needs, "mesh.tensor=2"]))
    assert run.preset == preset.split(",")[0]


def _cli(module, *args):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)


@pytest.mark.parametrize("args,message", [
    (["--config.eval.max_questions=-1"], "error: config key eval.max_questions must be in [0, 16777216] (0: all), got -1"),
    (["--max_questions=-1"], "error: --max_questions is gone; write --config.eval.max_questions=-1 instead"),
    (["--config.eval.batch_size=-5"], "error: config key eval.batch_size must be in [1, 65536], got -5"),
])
def test_evaluate_refuses_bad_flags_in_one_line(tmp_path, args, message):
    """`python -m workflow_r1.evaluate`'s flags: a bad value is one line and exit status 2, no traceback."""
    proc = _cli("workflow_r1.evaluate", "--config=configs/gsspo.py:tiny", f"--out={tmp_path / 'out'}", *args)
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert proc.returncode == 2 and lines == [message], proc.stderr[-2000:]


def test_train_refuses_a_nan_learning_rate_before_any_work(tmp_path):
    proc = _cli("workflow_r1.train", "--config=configs/gsspo.py:tiny", f"--workdir={tmp_path / 'w'}",
                "--config.train.learning_rate=nan")
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert proc.returncode == 2 and lines == ["error: config key train.learning_rate must be in (0, 1], got nan"], \
        proc.stderr[-2000:]
    assert not (tmp_path / "w" / "metrics.jsonl").exists()


def test_keep_shape_needs_the_filter_in_one_line():
    with pytest.raises(configlib.ConfigError) as e:
        run_config.Run.from_config(configlib.load(f"{CONFIGS}/gsspo.py:tiny", ["train.filter_keep_shape=True"]))
    line = str(e.value)
    assert line.endswith("set train.filter_groups=True or train.filter_keep_shape=False") and "\n" not in line, line


@pytest.mark.parametrize("key, value, line", [
    ("block_timeout_s", float("nan"), "block_timeout_s must be in [1, 86400] (seconds a code block may run), got nan"),
    ("block_timeout_s", 1e12, "block_timeout_s must be in [1, 86400] (seconds a code block may run), got 1000000000000.0"),
    ("block_timeout_s", 0, "block_timeout_s must be in [1, 86400] (seconds a code block may run), got 0"),
    ("worker_memory_mb", 16, "worker_memory_mb must be in [256, 4194304] (the REPL worker's address space, MB), got 16"),
    ("worker_cpu_s", 0, "worker_cpu_s must be in [1, 16777216] (the REPL worker's CPU seconds), got 0"),
    ("subagent_max_depth", -1, "subagent_max_depth must be in [0, 16] (0: no sub-agents), got -1"),
    ("max_candidate_chars", -5, "max_candidate_chars must be in [1, 16777216], got -5"),
    ("field_floor", float("inf"), "field_floor must be in [0, 1], got inf"),
])
def test_rlmopt_values_out_of_range_are_one_line(key, value, line):
    """rlmopt's settings are range-checked like the trainer's: refused when the config is built, before
    any LM call (0 or -1 for block_timeout_s used to kill every block and spend the budget)."""
    from rlmopt.config import RLMOptConfig

    with pytest.raises(ValueError) as e:
        RLMOptConfig(**{key: value})
    assert str(e.value) == line


def test_rlmopt_run_refuses_a_bad_value_before_any_work(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rlmopt.run", "--config.block_timeout_s=-1", f"--run_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=120, cwd=CONFIGS.parent)
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1].startswith("rlmopt.run: ")
    assert "block_timeout_s must be in [1, 86400]" in out.stderr and not any(tmp_path.iterdir())
