"""`style` (thorough | lean) and the settings that follow it (rlmopt/config.py STYLES)."""
import asyncio

import pytest

from rlmopt.config import RLMOptConfig, config_dict
from rlmopt.lm import ScriptedLM
from rlmopt.pipeline import optimise
from rlmopt.skill import skill_prompt
from rlmopt.tasks import intent_code
from workflow_r1 import configlib


def test_each_style_sets_its_stop_floor_and_advice_and_an_explicit_value_wins():
    thorough, lean = skill_prompt(RLMOptConfig()), skill_prompt(RLMOptConfig(style="lean"))
    assert "at least 80% of the budget" in thorough and "Work thoroughly" in thorough
    assert "at least 25% of the budget" in lean and "Work lean" in lean
    assert "Work thoroughly" not in lean
    mine = RLMOptConfig(style="lean", self_stop_floor_pct=0.5)
    assert mine.styled("self_stop_floor_pct") == 0.5 and "at least 50% of" in skill_prompt(mine)
    tuned = skill_prompt(RLMOptConfig(self_stop_target=0.9, self_stop_min_gain=0.01))
    assert "at least 0.9 on your latest" in tuned and "by at least 0.01." in tuned


def test_style_is_a_command_line_setting_and_bad_values_are_refused():
    cfg = config_dict()
    cfg.style = "lean"
    config = configlib.to_dataclass(RLMOptConfig, cfg, "config")
    assert config.styled("self_stop_floor_pct") == 0.25
    with pytest.raises(ValueError, match="use one of"):
        RLMOptConfig(style="quick")
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        RLMOptConfig(self_stop_floor_pct=80)


def test_the_agent_sees_its_style_and_the_record_names_it(tmp_path):
    opt = ScriptedLM(["```python\nfinal()\n```"])
    rec = asyncio.run(optimise(intent_code.build(), RLMOptConfig(budget=5, style="lean",
                                                                 polish_variants=False),
                               method="rlmopt", task_lm=intent_code.simulated_task_lm(),
                               optimizer_lm=opt, sub_lm=None, judge_lm=None, run_dir=tmp_path,
                               names={"task": "s", "optimizer": "o"}, log=lambda s: None))
    assert "at least 25% of the budget" in opt.prompts[0] and "Work lean" in opt.prompts[0]
    assert rec["extra"]["style"] == "lean" and rec["extra"]["self_stop_floor_pct"] == 0.25
