"""configs/*.py load, select the right loss, and reject wrong keys with a suggestion."""

import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest

from workflow_r1 import configlib

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name,granularity", [("gsspo", "subsequence"), ("grpo", "token"), ("gspo", "sequence")])
@pytest.mark.parametrize("preset", ["paper", "local", "tiny"])
def test_loss_configs_build_train_configs(name, granularity, preset):
    cfg = configlib.load(f"{CONFIGS / name}.py:{preset}")
    tc = configlib.train_config(cfg.train)
    assert tc.granularity == granularity
    if preset == "paper":  # docs/paper.md, Hyper-parameters
        assert (tc.learning_rate, tc.weight_decay, tc.max_grad_norm, tc.kl_coef, tc.num_mini_batches) == (
            1e-6, 0.01, 1.0, 0.001, 4)
        assert cfg.model.preset == "qwen2.5-7b"


def test_overrides_apply_and_typecheck():
    cfg = configlib.load(f"{CONFIGS}/gsspo.py:tiny", ["train.clip_eps_high=0.28", "train.tis_cap=2.0",
                                                       "model.dtype=bfloat16"])
    tc = configlib.train_config(cfg.train)
    assert tc.clip_eps_high == 0.28 and tc.tis_cap == 2.0 and cfg.model.dtype == "bfloat16"
    with pytest.raises(configlib.ConfigError, match="train.num_mini_batches"):
        configlib.load(f"{CONFIGS}/gsspo.py:tiny", ["train.num_mini_batches=lots"])


def test_wrong_key_names_the_fix():
    with pytest.raises(configlib.ConfigError, match=r"^config key train.clip_low unknown; did you mean train.clip_eps_low\?$"):
        configlib.load(f"{CONFIGS}/gsspo.py", ["train.clip_low=0.1"])
    with pytest.raises(configlib.ConfigError, match="config key trian unknown; did you mean train"):
        configlib.load(f"{CONFIGS}/gsspo.py", ["trian.kl_coef=0"])
    with pytest.raises(configlib.ConfigError, match="not found"):
        configlib.load("configs/nope.py")
    cfg = configlib.load(f"{CONFIGS}/grpo.py")
    cfg.train.unlock()
    cfg.train.lr = 1e-5
    with pytest.raises(configlib.ConfigError, match="train.lr unknown"):
        configlib.train_config(cfg.train)


def _other_value(name, default, accepted):
    """A value of the field's type that differs from its default and passes TrainConfig's checks."""
    if name == "granularity":
        return "token"
    if name == "advantage":
        return "rloo"
    kind = next(t for t in accepted if t is not type(None))
    if kind is bool:
        return not bool(default)
    if kind is int:
        return 3 if default in (None, 0, -1) else default + 1
    if kind is float:
        return 0.375 if default is None else default * 0.5 + 0.125
    raise AssertionError(f"no test value for TrainConfig.{name} of type {kind}")


def test_every_train_config_field_is_settable_from_the_command_line():
    from workflow_r1.rl.train_state import TrainConfig

    types_ = configlib._field_types(TrainConfig)
    # Fields that only mean something with another.
    needs = {"refill_rounds": ["train.filter_groups=True"], "filter_keep_shape": ["train.filter_groups=True"],
             "partial_rollouts": ["train.max_staleness=1"]}
    for f in dataclasses.fields(TrainConfig):
        value = _other_value(f.name, f.default, types_[f.name])
        cfg = configlib.load(f"{CONFIGS}/gsspo.py:tiny", [f"train.{f.name}={value}", *needs.get(f.name, [])])
        assert getattr(configlib.train_config(cfg.train), f.name) == value, f.name
    # Optional fields also take None, and a float field takes an int literal.
    cfg = configlib.load(f"{CONFIGS}/gsspo.py:tiny", ["train.micro_batch_size=None", "train.learning_rate=1"])
    tc = configlib.train_config(cfg.train)
    assert tc.micro_batch_size is None and tc.learning_rate == 1.0
    with pytest.raises(configlib.ConfigError, match=r"^config key train.micro_batch_size='x' must be int or None$"):
        configlib.train_config(configlib.load(f"{CONFIGS}/gsspo.py:tiny", ["train.micro_batch_size=x"]).train)


def test_command_line_errors_are_one_line(tmp_path):
    """An absl entry point with `--config`: a wrong key or file is one line on stderr, exit status 2."""
    prog = ("from ml_collections import config_flags; from workflow_r1 import configlib; "
            "c = config_flags.DEFINE_config_file('config'); "
            "configlib.app_run(lambda argv: print(configlib.train_config(c.value.train).clip_eps_high))")
    root = CONFIGS.parent

    def run(*args):
        return subprocess.run([sys.executable, "-c", prog, *args], cwd=tmp_path, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(root)}, timeout=120)

    ok = run(f"--config={CONFIGS}/gsspo.py:tiny", "--config.train.clip_eps_high=0.28")
    assert ok.returncode == 0 and ok.stdout.strip() == "0.28", ok.stderr
    bad = run(f"--config={CONFIGS}/gsspo.py:tiny", "--config.train.clip_low=0.1")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: config key train.clip_low unknown; did you mean train.clip_eps_low?"
    missing = run("--config=configs/nope.py")
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert "config file configs/nope.py not found" in missing.stderr


@pytest.mark.parametrize("name", ["gsspo", "grpo", "gspo"])
def test_every_preset_builds_a_checked_run(name):
    """Every section converts to its dataclass and the cross-section rules hold for each preset."""
    from workflow_r1 import run_config

    for preset in ("local", "tiny", "operators"):
        # The tests' 8 simulated devices as data 4 x tensor 2, so a micro-batch of 4 rows splits.
        run = run_config.Run.from_config(configlib.load(f"{CONFIGS}/{name}.py:{preset}", ["mesh.tensor=2"]))
        assert run.train.temperature == run.rollout.temperature and run.preset == preset
    # The synthetic task's preset takes its budgets from its environment (one source).
    from workflow_r1.envs import operators

    assert run.env.kind == "operators" and all(getattr(run.rollout, k) == v for k, v in operators.ROLLOUT.items())
    with pytest.raises(configlib.ConfigError, match=r"^the paper preset needs --config.executor.url"):
        run_config.Run.from_config(configlib.load(f"{CONFIGS}/{name}.py:paper"))
    run = run_config.Run.from_config(configlib.load(f"{CONFIGS}/{name}.py:paper", [
        "executor.url=http://executor:8000", "data.train_files=train_10k.jsonl"]))
    assert (run.rollout.prompts_per_step, run.rollout.n, run.rollout.max_prompt_tokens,
            run.rollout.max_response_tokens, run.executor.search_topk, run.run.epochs) == (512, 8, 1280, 8192, 5, 2)
    # One reference for both temperatures: overriding the rollout's moves the trainer's.
    cfg = configlib.load(f"{CONFIGS}/{name}.py:tiny", ["rollout.temperature=0.7"])
    assert cfg.train.temperature == 0.7


def test_tight_clip_variant():
    cfg = configlib.load(f"{CONFIGS}/gsspo.py:local,tight")
    assert (cfg.train.clip_eps_low, cfg.train.clip_eps_high) == (3e-4, 4e-4)
    assert configlib.load(f"{CONFIGS}/gspo.py:tiny,tight").train.clip_eps_high == 4e-4
    with pytest.raises(configlib.ConfigError, match="variant tight is the GSPO paper's clip range"):
        configlib.load(f"{CONFIGS}/grpo.py:local,tight")
    with pytest.raises(configlib.ConfigError, match="unknown variant 'loose'"):
        configlib.load(f"{CONFIGS}/gsspo.py:local,loose")


def test_a_command_lines_overrides_as_load_takes_them():
    """What launch/sweep.py and the ablation pass on to every run: each `--config.key=value` in
    order, `--config.key value` too, and a bool given alone or negated; other flags are not theirs."""
    cfg = configlib.load(f"{CONFIGS}/gsspo.py:tiny")
    argv = ["--config=x.py:tiny", "--seeds=2", "--config.steps=3", "--config.train.learning_rate", "1e-3",
            "--noconfig.tensorboard", "--config.checkpoint.export_hf", "--workdir=/w",
            "--config.executor.url=http://a:1,http://b:2"]
    overrides = configlib.override_args(argv, cfg)
    assert overrides == ["steps=3", "train.learning_rate=1e-3", "tensorboard=False", "checkpoint.export_hf=True",
                         "executor.url=http://a:1,http://b:2"]
    loaded = configlib.load(f"{CONFIGS}/gsspo.py:tiny", overrides)
    assert (loaded.steps, loaded.train.learning_rate, loaded.tensorboard) == (3, 1e-3, False)
