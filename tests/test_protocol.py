"""Protocol: turn parser, observation formatting and truncation, prompt template, episode limits."""
import re

import pytest
from hypothesis import given, settings, strategies as st

from workflow_r1.task import operators, protocol
from workflow_r1.task.protocol import Action, parse_turn

PLAIN = operators.pool_for("workflow_r1")
SEARCH = operators.pool_for("workflow_r1_search")
WARN = Action("warning", "WarningOp", operators.WARNING_TEXT)


# ------------------------------------------------------------------------------------------------
# Pools

def test_variant_pools_match_the_paper():
    # docs/paper.md, The multi-turn protocol: the plain pool in this order; Search replaces MultiAnswerGenerate.
    assert PLAIN == ("AnswerGenerate", "Custom", "PromptOptimizer", "Review", "Revise",
                     "MultiAnswerGenerate", "ScEnsemble")
    assert SEARCH == tuple("Search" if n == "MultiAnswerGenerate" else n for n in PLAIN)
    assert operators.pool_for("Workflow-R1-Search") == SEARCH
    assert "WarningOp" not in operators.pool_for("all")
    assert len(operators.OPERATORS) == 9


def test_pool_errors_name_the_fix():
    with pytest.raises(ValueError, match="workflow_r1_search"):
        operators.pool_for("workflow_r2")
    with pytest.raises(ValueError, match="Bogus"):
        operators.pool_for(["AnswerGenerate", "Bogus"])
    assert operators.pool_for(["Search", "Review"]) == ("Search", "Review")


# ------------------------------------------------------------------------------------------------
# Parser: table of cases, expected actions written out by hand from the rules in docs/paper.md (The multi-turn protocol; Our choices)

PARSE_CASES = [
    ("plain tool", "<think>hm</think>\n<tool>AnswerGenerate: What is 2+2?</tool>",
     PLAIN, Action("tool", "AnswerGenerate", "What is 2+2?")),
    ("split at first colon only", "<tool>Custom: <task>a: b</task><instruction>c</instruction></tool>",
     PLAIN, Action("tool", "Custom", "<task>a: b</task><instruction>c</instruction>")),
    ("whitespace stripped", "<tool>\n  Review :  <question>q</question>\n</tool>",
     PLAIN, Action("tool", "Review", "<question>q</question>")),
    ("multiline content", "<tool>AnswerGenerate: line1\nline2</tool>",
     PLAIN, Action("tool", "AnswerGenerate", "line1\nline2")),
    ("first tool wins", "<tool>Review: a</tool><tool>Revise: b</tool>",
     PLAIN, Action("tool", "Review", "a")),
    ("answer ends the episode", "<think>sure</think><answer> Paris </answer>",
     PLAIN, Action("answer", None, "Paris")),
    ("empty answer still ends", "<answer></answer>", PLAIN, Action("answer", None, "")),
    ("answer before tool: answer", "<answer>x</answer><tool>Review: y</tool>",
     PLAIN, Action("answer", None, "x")),
    ("tool before answer: tool", "<tool>Review: y</tool><answer>x</answer>",
     PLAIN, Action("tool", "Review", "y")),
    ("answer nested in tool: tool", "<tool>AnswerGenerate: say <answer>x</answer></tool>",
     PLAIN, Action("tool", "AnswerGenerate", "say <answer>x</answer>")),
    ("no tags", "I think the answer is Paris.", PLAIN, WARN),
    ("unclosed tool", "<think>a</think><tool>AnswerGenerate: q", PLAIN, WARN),
    ("unclosed answer", "<answer>Paris", PLAIN, WARN),
    ("tool without colon", "<tool>AnswerGenerate what is x</tool>", PLAIN, WARN),
    ("tool with empty name", "<tool>: what is x</tool>", PLAIN, WARN),
    ("empty turn", "", PLAIN, WARN),
    ("empty content is still a call", "<tool>AnswerGenerate:</tool>",
     PLAIN, Action("tool", "AnswerGenerate", "")),
    ("Search allowed in search pool", "<tool>Search: capital of Peru</tool>",
     SEARCH, Action("tool", "Search", "capital of Peru")),
]


@pytest.mark.parametrize("name,text,pool,expected", PARSE_CASES, ids=[c[0] for c in PARSE_CASES])
def test_parse_turn(name, text, pool, expected):
    assert parse_turn(text, pool) == expected


def test_out_of_pool_operator_gets_the_available_list():
    action = parse_turn("<tool>Search: capital of Peru</tool>", PLAIN)
    assert action.kind == "warning" and action.operator == "Search"
    assert action.content == ("Unknown operator: Search. Available operators: [AnswerGenerate, "
                              "Custom, PromptOptimizer, Review, Revise, MultiAnswerGenerate, "
                              "ScEnsemble]")
    # Names are case-sensitive, as in the release's dispatch table.
    assert parse_turn("<tool>answergenerate: q</tool>", PLAIN).kind == "warning"
    # A garbage name is echoed back shortened.
    long = parse_turn(f"<tool>{'X' * 500}: q</tool>", PLAIN)
    assert long.kind == "warning" and len(long.content) < 300


def test_warning_text_is_the_papers_first_person_text():
    text = operators.WARNING_TEXT
    assert text.startswith("WARNING!!! I did not follow the required format.")
    assert "<tool>OperatorName: input</tool>" in text and "<answer>...</answer>" in text


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("<>/:toolanswerthink AZ\n")), max_size=200)
       | st.text(max_size=300))
def test_parse_turn_never_raises(text):
    action = parse_turn(text, PLAIN)
    assert action.kind in ("tool", "answer", "warning")
    if action.kind == "tool":
        assert action.operator in PLAIN
    if action.kind == "warning":
        assert action.content


# ------------------------------------------------------------------------------------------------
# Observations

def test_truncation_keeps_head_and_tail_around_marker():
    text = "".join(chr(ord("a") + i % 26) for i in range(5000))
    out = protocol.truncate_middle(text, 2048)
    assert out == text[:1024] + "...(truncated)..." + text[-1024:]
    assert len(out) == 2048 + len("...(truncated)...")


@pytest.mark.parametrize("n", [0, 1, 2047, 2048])
def test_no_truncation_up_to_the_limit(n):
    text = "x" * n
    assert protocol.truncate_middle(text) == text
    assert protocol.format_observation(text) == f"<info>{text}</info>"


def test_truncation_just_over_the_limit_and_odd_limits():
    text = "".join(str(i % 10) for i in range(2049))
    assert protocol.truncate_middle(text) == text[:1024] + "...(truncated)..." + text[-1024:]
    assert protocol.truncate_middle("abcdefgh", 5) == "ab...(truncated)...fgh"
    assert protocol.truncate_middle("abcdefgh", 1) == "...(truncated)...h"
    assert protocol.truncate_middle("abcdefgh", 0) == "...(truncated)..."


def test_format_observation_wraps_after_truncation():
    text = "A" * 1500 + "B" * 1500
    obs = protocol.format_observation(text)
    assert obs == "<info>" + "A" * 1024 + "...(truncated)..." + "B" * 1024 + "</info>"
    assert protocol.format_tool_response(obs) == f"<tool_response>\n{obs}\n</tool_response>"


# ------------------------------------------------------------------------------------------------
# Prompt

def test_build_messages_lists_exactly_the_pool_from_the_registry():
    for variant, pool in (("workflow_r1", PLAIN), ("workflow_r1_search", SEARCH)):
        messages = protocol.build_messages("What is the capital of France?", variant)
        assert [m["role"] for m in messages] == ["system", "user"]
        user = messages[1]["content"]
        for name in operators.OPERATORS:
            listed = f"Usage: {operators.OPERATORS[name].usage}" in user
            assert listed == (name in pool), name
        numbered = re.findall(r"^(\d+)\. (\w+)$", user, flags=re.MULTILINE)
        assert numbered == [(str(i), n) for i, n in enumerate(pool, 1)]
        assert user.rstrip().endswith("Query: What is the capital of France?")


def test_prompt_states_the_protocol_constraints():
    user = protocol.render_user_prompt("q")
    for phrase in ("<think>", "</think>", "<info>", "</info>", "<answer>", "</answer>",
                   "MAXIMUM of 20 operator calls", "CRITICAL INSTRUCTION", "IMPORTANT CONSTRAINT",
                   "Available Operators:"):
        assert phrase in user, phrase
    assert "{" not in user.replace("{}", "")  # every placeholder filled


def test_question_with_braces_is_inserted_verbatim():
    user = protocol.render_user_prompt("What is {x} in set {1, 2}?")
    assert user.endswith("Query: What is {x} in set {1, 2}?")


# ------------------------------------------------------------------------------------------------
# Limits

def test_episode_limits():
    tool = Action("tool", "AnswerGenerate", "q")
    answer = Action("answer", None, "x")
    assert protocol.should_stop(answer, 1, 0) == protocol.FINISH_ANSWER
    assert protocol.should_stop(answer, 21, 20) == protocol.FINISH_ANSWER  # an answer on the last turn counts
    assert protocol.should_stop(tool, 1, 0) is None
    assert protocol.should_stop(tool, 20, 19) is None  # the 20th call still runs
    assert protocol.should_stop(tool, 20, 20) == protocol.FINISH_CALL_CAP  # no 21st call
    assert protocol.should_stop(tool, 21, 20) == protocol.FINISH_TURN_CAP  # the turn cap is checked first
    assert protocol.should_stop(WARN, 21, 5) == protocol.FINISH_TURN_CAP
    assert protocol.should_stop(tool, 3, 2, max_operator_calls=2, max_assistant_turns=4) == protocol.FINISH_CALL_CAP
    assert protocol.MAX_OPERATOR_CALLS == 20 and protocol.MAX_ASSISTANT_TURNS == 21


# ------------------------------------------------------------------------------------------------
# Registry templates

def test_every_llm_operator_template_is_valid_and_names_its_tags():
    for spec in operators.OPERATORS.values():
        if spec.template is None:
            assert not spec.uses_llm
            continue
        operators.validate_template(spec.name, spec.template)
        for tag in spec.required_tags:
            assert f"<{tag}>" in spec.template, (spec.name, tag)


@pytest.mark.parametrize("template,match", [
    ("Solve {input} and {other}", "other"),
    ("Solve {input.__class__}", "input.__class__"),
    ("Solve {input!r}", "conversion or format spec"),
    ("Solve {input:>99999}", "conversion or format spec"),
    ("Solve it", "never uses"),
    ("Solve {input", "not a valid"),
])
def test_validate_template_rejects(template, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        operators.validate_template("AnswerGenerate", template)


def test_a_turn_is_decided_once_no_later_text_can_change_its_action():
    """`turn_decided`: where rollout.stop_at_action may end a turn. It agrees with `parse_turn` on
    every prefix: once decided, any continuation parses to the same action."""
    decided = {"<think>a</think><tool>Search: x</tool>": True, "<answer>Paris</answer>": True,
               "<think>a</think><tool>Search: x</to": False, "no tags": False,
               "<tool>Review: <solution><answer>x</answer>": False,   # the tool may still close, and it opened first
               "<answer>x <tool>Search: y</tool>": False,             # the answer may still close, and it opened first
               "<tool>Search: y</tool> <answer>": True, "<answer>x</answer><tool>": True}
    for text, want in decided.items():
        assert protocol.turn_decided(text) is want, text
        if want:
            for tail in ("</answer>", "</tool>", " <answer>z</answer>", "<tool>Search: q</tool>"):
                assert protocol.parse_turn(text + tail, ["Search", "Review"]) == protocol.parse_turn(text, ["Search", "Review"])
