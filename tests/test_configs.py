"""configs/*.py load, select the right loss, and reject wrong keys with a suggestion."""

import pathlib

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
        configlib.set_key(cfg, "train.num_mini_batches=lots")


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
