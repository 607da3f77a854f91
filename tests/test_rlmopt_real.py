"""A small real run: the bundled Qwen2.5-Coder-0.5B-Instruct as task LM and optimizer on
the intent-code task. A low score is fine; the run must be sound: it finishes, spends no more than
its budget, writes a valid record.json, and never ends below its seed on validation."""
import asyncio
import json

import pytest

from rlmopt.config import RLMOptConfig
from rlmopt.lm import build_lm
from rlmopt.run import optimise
from rlmopt.tasks import intent_code


@pytest.mark.real_model
def test_small_real_run_is_sound(qwen05b_dir, tmp_path):
    lm = build_lm(f"local:{qwen05b_dir}")
    # CPU-sized: one agent turn of 64 tokens, one polish variant, no sub-LM (about 55 s of CPU)
    config = RLMOptConfig(budget=19, optimizer_max_iterations=1, optimizer_max_tokens=64,
                          polish_demos=(3,), block_timeout_s=30)
    logs = []
    rec = asyncio.run(optimise(intent_code.build(), config, method="rlmopt", task_lm=lm,
                               optimizer_lm=lm, sub_lm=None, judge_lm=None, run_dir=tmp_path,
                               names={"task": "local", "optimizer": "local"}, log=logs.append))
    print("\n".join(logs))
    saved = json.loads((tmp_path / "record.json").read_text())
    assert saved == json.loads(json.dumps(rec))
    assert 0 <= saved["rollouts_used"] <= 19 and saved["extra"]["agent_iterations"] == 1
    assert saved["val_score"] >= saved["seed_val_score"]
    assert len(saved["per_example_test"]) == 19 and 0.0 <= saved["test_score"] <= 1.0
    assert saved["extra"]["calls_by_role"]["optimizer"] >= 1 and saved["extra"]["calls_by_role"]["task"] >= 38
    assert {p["label"] for p in saved["pool"]} >= {"seed", "polish:demos3"}
