"""Reward (docs/paper.md, Reward): the six reward values, format edge cases, EM normalisation."""
import pytest
from hypothesis import given, settings, strategies as st

from workflow_r1.task.reward import (compute_reward, exact_match, extract_answer, format_reward,
                                    normalize_answer, top_level_tags)

GOLD = ["Paris"]
OBS = "<tool_response>\n<info>AnswerGenerate answer: Paris</info>\n</tool_response>"
VALID_TOOL_ROUND = f"<think>I should ask.</think>\n<tool>AnswerGenerate: capital of France?</tool>{OBS}"


def response(*parts: str) -> str:
    return "".join(parts)


# (case, response, gold, expected total, expected format, expected outcome); expected values come
# from the table in docs/paper.md (Reward), not from running the code.
SIX_VALUES = [
    ("valid, correct", "<think>Easy.</think><answer>Paris</answer>", GOLD, 1.0, 0.0, 1.0),
    ("valid multi-turn, correct",
     response(VALID_TOOL_ROUND, "<think>It says Paris.</think>\n<answer>Paris</answer>"),
     GOLD, 1.0, 0.0, 1.0),
    ("valid, wrong", "<think>Hmm.</think><answer>Lyon</answer>", GOLD, 0.0, 0.0, 0.0),
    ("invalid (no think), correct", "<answer>Paris</answer>", GOLD, 0.5, -0.5, 1.0),
    ("invalid (no think), wrong", "<answer>Lyon</answer>", GOLD, -0.5, -0.5, 0.0),
    ("valid, empty answer", "<think>No idea.</think><answer>  </answer>", GOLD, -1.0, 0.0, -1.0),
    ("no answer at all", "<think>Let me think.</think>", GOLD, -1.5, -0.5, -1.0),
    ("empty response", "", GOLD, -1.5, -0.5, -1.0),
]


@pytest.mark.parametrize("case,text,gold,total,fmt,outcome", SIX_VALUES, ids=[c[0] for c in SIX_VALUES])
def test_six_reward_values(case, text, gold, total, fmt, outcome):
    r = compute_reward(text, gold)
    assert (r.total, r.format, r.outcome) == (total, fmt, outcome)


# Format edge cases: (case, response, expected format reward)
FORMAT_CASES = [
    ("two tools in one turn",
     "<think>a</think><tool>Review: x</tool><tool>Revise: y</tool>" + OBS
     + "<think>b</think><answer>Paris</answer>", -0.5),
    ("answer not last", "<think>a</think><answer>Paris</answer><think>more</think>", -0.5),
    ("answer then tool", "<think>a</think><answer>Paris</answer><tool>Review: x</tool>", -0.5),
    ("unclosed think swallows the rest",
     "<think>a <tool>AnswerGenerate: q</tool>" + OBS + "<think>b</think><answer>Paris</answer>", -0.5),
    ("empty think", "<think>  </think><answer>Paris</answer>", -0.5),
    ("empty tool", "<think>a</think><tool> </tool>" + OBS + "<think>b</think><answer>P</answer>", -0.5),
    ("tool without observation", "<think>a</think><tool>AnswerGenerate: q</tool><think>b</think>"
     "<answer>Paris</answer>", -0.5),
    ("no think after observation", VALID_TOOL_ROUND + "<answer>Paris</answer>", -0.5),
    ("unknown top-level tag", "<think>a</think><search>x</search><answer>Paris</answer>", -0.5),
    ("tags nested in tool and observation are ignored",
     "<think>a</think><tool>Review: <question>q</question><solution>s</solution></tool>"
     "<tool_response>\n<info>Review feedback: <b>fine</b> <answer>x</answer></info>\n</tool_response>"
     "<think>b</think><answer>Paris</answer>", 0.0),
    ("bare info block counts as an observation",
     "<think>a</think><tool>AnswerGenerate: q</tool><info>Paris</info><think>b</think>"
     "<answer>Paris</answer>", 0.0),
    ("text outside tags is ignored", "Sure! <think>a</think> so... <answer>Paris</answer> done", 0.0),
    ("stray close tag is ignored", "</tool><think>a</think></think><answer>Paris</answer>", 0.0),
    ("close tag must match the innermost open tag",
     "<think>a<b>c</think></b><answer>Paris</answer>", -0.5),
    ("tag with attributes counts by its name", "<think id=1>a</think><answer>Paris</answer>", 0.0),
    ("comment-like tags are skipped", "<!-- x --><think>a</think><answer>Paris</answer>", 0.0),
    ("less-than in prose without closing bracket", "<think>a</think><answer>Paris</answer> 3 < 4", 0.0),
    ("two full rounds", VALID_TOOL_ROUND + "<think>b</think><tool>Review: x</tool>" + OBS
     + "<think>c</think><answer>Paris</answer>", 0.0),
]


@pytest.mark.parametrize("case,text,expected", FORMAT_CASES, ids=[c[0] for c in FORMAT_CASES])
def test_format_edge_cases(case, text, expected):
    assert format_reward(text) == expected


def test_top_level_tags_contents():
    text = "x<think> a <b>y</b> </think>z<answer>P</answer>"
    assert top_level_tags(text) == [("think", " a <b>y</b> "), ("answer", "P")]


def test_answer_extraction_uses_the_last_block_of_the_whole_response():
    # Code-faithful (docs/paper.md, Reward): an <answer> inside an observation can be picked up if it is last.
    text = "<think>a</think><answer>Lyon</answer> <answer>\n Paris \n</answer>"
    assert extract_answer(text) == "Paris"
    assert extract_answer("no answer") is None
    assert extract_answer("<answer>unclosed") is None
    assert compute_reward(text, GOLD).outcome == 1.0


@pytest.mark.parametrize("raw,normalized", [
    ("The Eiffel Tower!", "eiffel tower"),
    ("  a  cat,  AN  apple  ", "cat apple"),
    ("Theater", "theater"),  # articles only as whole words
    ("U.S.A.", "usa"),
    ("rock-n-roll", "rocknroll"),
    ("Bras\u00edlia", "bras\u00edlia"),  # non-ASCII letters kept
    ("", ""),
])
def test_normalize_answer(raw, normalized):
    assert normalize_answer(raw) == normalized


def test_exact_match_against_any_gold():
    assert exact_match("the  Yangtze River.", ["Chang Jiang", "Yangtze river"]) == 1.0
    assert exact_match("Yangtze", ["Yangtze River"]) == 0.0  # exact, not substring
    assert exact_match("paris", "Paris") == 1.0  # a single gold string
    import numpy as np
    assert exact_match("6", np.array(["6", "six"])) == 1.0  # Search-R1 parquet rows hold arrays


SIX_TOTALS = {1.0, 0.0, 0.5, -0.5, -1.0, -1.5}


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=300), st.lists(st.sampled_from(
    ["<think>", "</think>", "<tool>", "</tool>", "<answer>", "</answer>", "<tool_response>",
     "</tool_response>", "<info>", "</info>", "Paris", " ", "x", "<", ">", "/", "\n", "<!"]),
    max_size=40).map("".join)))
def test_reward_never_raises_and_takes_one_of_six_values(text):
    r = compute_reward(text, GOLD)
    assert r.format in (0.0, -0.5)
    assert r.outcome in (1.0, 0.0, -1.0)
    assert r.total == r.format + r.outcome and r.total in SIX_TOTALS
    if "answer" not in text:
        assert r.total == -1.5  # no answer is always format-invalid
