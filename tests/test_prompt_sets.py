"""Environment fidelity: the faithful prompt carries every instruction of the paper's appendix D,
prompt sets are selectable data honoured by the policy prompt and the executor, the paper preset's
Search renders title + snippet results, and the reward's WarningOp quirk and per-operator
observation sizes are counted."""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from configs import base
from workflow_r1.data.questions import Question
from workflow_r1.task import operators, prompt_sets, protocol, reward
from workflow_r1.task.config import EnvConfig
from workflow_r1.task.operators import WARNING_TEXT
from workflow_r1.executor import ExecutorClient, FakeBackend, ServerConfig, start_in_thread
from workflow_r1.executor.operators_exec import OperatorRunner
from workflow_r1.executor.search import BM25Search, Passage, render_results, snippet
from workflow_r1.rollout.episode import Episode, Turn
from workflow_r1.rollout.stats import episode_metrics

REPO = Path(__file__).resolve().parent.parent

# Every instruction of the paper's prompt template (appendix D.1), as facts: each is a list of
# patterns that must all occur (case-sensitive where the paper capitalises for emphasis).
POLICY_FACTS = {
    "answer the question": [r"Answer the question"],
    "think inside the think tags": [r"<think> and </think>"],
    "think after every operator result, many times": [r"Whenever an operator gives you new information, you must reason",
                                                      r"think many times, once after every result",
                                                      r"not only once at the start"],
    "call an operator when it helps": [r"if you see that an operator could make a correct answer more likely"],
    "MUST follow the operator's format": [r"MUST be written in exactly that operator's format"],
    "operator list header": [r"Available Operators:\n1\. "],
    "reason before each call: why, how, what to learn": [r"Before every operator call, you must explain",
                                                          r"your reason for picking this operator",
                                                          r"how you will use it", r"what you hope to learn"],
    "results come back in info tags": [r"between <info> and </info>"],
    "think after the result: meaning, use, next step": [r"you must think again", r"what does the result tell you",
                                                        r"move you toward answering the original question",
                                                        r"which step should you take next"],
    "exploration demand": [r"CRITICAL INSTRUCTION:",
                           r"Never content yourself with simple calls that use one operator in a single step",
                           r"You are REQUIRED to be aggressive", r"varied, intricate and unorthodox combinations",
                           r"exhaustively investigate", r"reinforce one another",
                           r"push what the operators can achieve together",
                           r"passive, lazy or simplistic will not be accepted", r"deep reasoning",
                           r"rich, multi-step orchestration", r"unique strengths", r'"magical" effects'],
    "20-call limit": [r"IMPORTANT CONSTRAINT: You may make a MAXIMUM of 20 operator calls",
                      r"Plan your strategy carefully",
                      r"collect enough information and arrive at a confident answer without exceeding this limit"],
    "the cycle": [r"Always work in this cycle: think; then call an operator if one is needed; when its "
                  r"information arrives, think again; then decide what to do next",
                  r"Keep repeating the cycle until the information you hold is enough for a confident answer"],
    "answer only when truly certain, in a few words, in answer tags": [
        r"several thinking cycles", r"truly certain", r"inside <answer> and </answer>",
        r"in a few words or one short phrase", r"answers the query exactly",
        r"If you are not certain, keep reasoning and gathering information"],
    "the query last": [r"\n\nQuery: Who wrote Hamlet\?$"],
}

# Every piece of operator information (appendix D.1 and the release's operator list): each
# operator's purpose, when to use it, its input and its output.
OPERATOR_FACTS = {
    "AnswerGenerate": [r"advanced LLM", r"think a question through and answer it", r"domain-specific",
                       r"knowledge questions", r"reasoning tasks"],
    "Custom": [r"any task you define", r"clear, detailed instruction together with the task content",
               r"practically anything you need"],
    "PromptOptimizer": [r"refine and optimize", r"adding details", r"step-by-step plan", r"ambiguous",
                        r"lacks the context", r"better version"],
    "Review": [r"review critically whether a solution is correct", r"feedback", r"before you finalize",
               r"decide what to do next"],
    "Revise": [r"revise a solution according to feedback", r"critical feedback", r"something in the solution is wrong",
               r"improved solution"],
    "MultiAnswerGenerate": [r"advanced LLM", r"several independent answers \(3\) to the same question",
                            r"different lines of reasoning", r"several perspectives", r"choose from with an ensemble",
                            r"separate call", r"labelled \[Answer 1\], \[Answer 2\] and \[Answer 3\]"],
    "ScEnsemble": [r"best answer among several candidate solutions", r"self-consistency", r"most reliable",
                   r"voting", r"randomness of a single attempt", r"at least two candidates",
                   r"its own <solution></solution> tags"],
    "Search": [r"search engine", r"facts that you do not already have"],
}

USAGES = {
    "AnswerGenerate": "<tool>AnswerGenerate: YOUR_QUESTION</tool>",
    "Custom": "<tool>Custom: <task>YOUR_TASK_CONTENT</task><instruction>YOUR_INSTRUCTION</instruction></tool>",
    "PromptOptimizer": "<tool>PromptOptimizer: YOUR_QUERY</tool>",
    "Review": "<tool>Review: <question>ORIGINAL_QUESTION</question><solution>SOLUTION_TO_REVIEW</solution></tool>",
    "Revise": "<tool>Revise: <question>ORIGINAL_QUESTION</question><solution>SOLUTION_TO_REVISE</solution>"
              "<feedback>FEEDBACK_RECEIVED</feedback></tool>",
    "MultiAnswerGenerate": "<tool>MultiAnswerGenerate: YOUR_QUESTION</tool>",
    "ScEnsemble": "<tool>ScEnsemble: <query>ORIGINAL_QUESTION</query><solution>CANDIDATE_1</solution>..."
                  "<solution>CANDIDATE_N</solution></tool>",
    "Search": "<tool>Search: YOUR_QUERY</tool>",
}

POOLS = {"workflow_r1": ["AnswerGenerate", "Custom", "PromptOptimizer", "Review", "Revise", "MultiAnswerGenerate",
                         "ScEnsemble"],
         "search": ["AnswerGenerate", "Custom", "PromptOptimizer", "Review", "Revise", "Search", "ScEnsemble"]}


def _operator_block(prompt: str, name: str) -> str:
    """The text of operator `name`'s entry in the prompt's numbered list."""
    match = re.search(rf"\n\d+\. {name}\n(.*?)(?=\n\n\d+\. |\n\nBefore every operator call)", prompt, re.S)
    assert match, f"{name} is not listed"
    return match.group(1)


@pytest.mark.parametrize("variant", sorted(POOLS))
def test_faithful_prompt_states_every_instruction_and_operator_fact(variant):
    system, user = EnvConfig(variant=variant).messages("Who wrote Hamlet?")
    assert system["role"] == "system" and "expert in reasoning and problem solving" in system["content"]
    prompt = user["content"]
    missing = [(fact, p) for fact, patterns in POLICY_FACTS.items() for p in patterns if not re.search(p, prompt)]
    assert not missing, missing
    assert re.findall(r"\n\d+\. (\w+)\n", prompt) == POOLS[variant]  # in order; WarningOp never listed
    for name in POOLS[variant]:
        block = _operator_block(prompt, name)
        assert block.endswith(f"\nUsage: {USAGES[name]}"), (name, block)
        missing = [p for p in OPERATOR_FACTS[name] if not re.search(p, block)]
        assert not missing, (name, missing)


def test_default_executor_prompts_add_no_instruction_the_paper_lacks():
    faithful, concise = prompt_sets.load("faithful"), prompt_sets.load("concise")
    extras = {"AnswerGenerate": r"few words|short phrase", "PromptOptimizer": r"[Dd]o not answer",
              "ScEnsemble": r"letter"}
    for name, pattern in extras.items():
        assert not re.search(pattern, faithful.templates[name]), name
        assert re.search(pattern, concise.templates[name]), name  # kept in the alternative set
    assert faithful.templates == {n: s.template for n, s in operators.OPERATORS.items() if s.uses_llm}
    assert faithful.templates["MultiAnswerGenerate"] == faithful.templates["AnswerGenerate"]
    # What each faithful executor prompt asks for, as in the release's prompts.
    asks = {"AnswerGenerate": [r"step by step", r"in detail inside <think></think>", r"without any explanation"],
            "PromptOptimizer": [r"information and details", r"AI agent", r"refined query"],
            "Review": [r"critically", r"more than 95% confident", r"explain why the solution is correct",
                       r"MUST put your whole feedback inside <feedback></feedback>"],
            "Revise": [r"judged incorrect", r"MUST reason inside <think></think>", r"revised answer"],
            "ScEnsemble": [r"occurs most often", r"most reliable", r"reasoning behind each solution"]}
    for name, patterns in asks.items():
        assert all(re.search(p, faithful.templates[name]) for p in patterns), name


def test_local_set_is_the_concise_one_with_a_worked_example():
    """`local` = faithful <- concise <- local/policy.txt: the concise executor prompts and operator
    descriptions, a user message of its own that shows a whole call-then-answer exchange."""
    concise, local = prompt_sets.load("concise"), prompt_sets.load("local")
    assert local.templates == concise.templates and local.descriptions == concise.descriptions
    assert local.system == concise.system and local.policy != concise.policy
    text = EnvConfig(prompt_set="local", max_operator_calls=2).messages("Q?")[1]["content"]
    assert "<tool>AnswerGenerate: " in text and "<answer>" in text and "at most 2 operators" in text
    assert text.rstrip().endswith("Question: Q?")
    assert len(text) < len(EnvConfig(prompt_set="concise").messages("Q?")[1]["content"])
    # `local_search`, the local preset's (the Search variant): the same set whose example searches,
    # opening with a worked episode as chat turns (demonstration.json) before the question.
    search = prompt_sets.load("local_search")
    assert search.templates == concise.templates and search.descriptions == concise.descriptions
    demo = search.demonstration
    messages = EnvConfig(variant="search", prompt_set="local_search", max_operator_calls=2).messages("Q?")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "user"]
    text = messages[1]["content"]
    assert "<tool>Search: " in text and "<tool>AnswerGenerate: " not in text.split("How the turns look")[1]
    assert "Usage: <tool>Search: YOUR_QUERY</tool>" in text and text.rstrip().endswith(f"Question: {demo.question}")
    assert messages[-1] == {"role": "user", "content": "Question: Q?"}
    # The worked episode is one the environment would give: its turns parse to a search and an answer,
    # its observation is what the bundled corpus's BM25 returns for that query, and it scores 1.
    first, observation, last = (c for _, c in demo.messages)
    call = protocol.parse_turn(first, operators.pool_for("search"))
    assert call.kind == "tool" and call.operator == "Search"
    assert observation == protocol.format_observation(render_results(call.content, BM25Search().search_sync(
        call.content, base.get_config("local").executor.search_topk)))
    assert protocol.parse_turn(last, operators.pool_for("search")).content in observation
    assert reward.compute_reward(f"{first}\n{observation}\n{last}", ["K2"]).total == 1.0


@pytest.mark.parametrize("text, match", [
    ("not json", "is not JSON"),
    ('{"question": "Q", "messages": []}', "exactly the keys"),
    ('{"question": "Q", "messages": [{"role": "tool", "content": "x"}], "then": "{question}"}', "alternating"),
    ('{"question": "Q", "messages": [{"role": "assistant", "content": "a"}], "then": "Q: {q}"}', "exactly {question}"),
])
def test_a_bad_demonstration_is_one_line_naming_the_file(tmp_path, text, match):
    (tmp_path / "demonstration.json").write_text(text)
    prompt_sets.load.cache_clear()
    with pytest.raises(ValueError, match=match) as info:
        prompt_sets.load(str(tmp_path))
    assert "demonstration.json" in str(info.value) and "\n" not in str(info.value)


def test_concise_set_is_the_shorter_earlier_prompt():
    faithful = EnvConfig().messages("Q?")[1]["content"]
    concise = EnvConfig(prompt_set="concise").messages("Q?")[1]["content"]
    assert "IMPORTANT CONSTRAINT: You have a MAXIMUM of 20 operator calls" in concise
    assert "aggressive" not in concise and len(concise) < 0.8 * len(faithful)


def test_a_set_directory_replaces_only_its_files(tmp_path):
    (tmp_path / "AnswerGenerate.template.txt").write_text("Answer tersely: {input}\n<think></think><answer></answer>\n")
    (tmp_path / "Review.description.txt").write_text("Checks an answer.\n")
    (tmp_path / ".hidden").write_text("editor state")
    mine, faithful = prompt_sets.load(str(tmp_path)), prompt_sets.load()
    assert mine.templates["AnswerGenerate"] == "Answer tersely: {input}\n<think></think><answer></answer>"
    assert mine.templates["MultiAnswerGenerate"] == mine.templates["AnswerGenerate"]  # follows AnswerGenerate
    assert {n: t for n, t in mine.templates.items() if "AnswerGenerate" not in n} == \
        {n: t for n, t in faithful.templates.items() if "AnswerGenerate" not in n}
    assert (mine.policy, mine.system) == (faithful.policy, faithful.system)
    env = EnvConfig(prompt_set=str(tmp_path))
    assert "4. Review\nDescription: Checks an answer.\nUsage:" in env.messages("Q?")[1]["content"]
    assert env.operator_templates()["AnswerGenerate"].startswith("Answer tersely")


@pytest.mark.parametrize("filename, text, message", [
    ("AnswerGenerate.template.txt", "Solve {question}", r"AnswerGenerate\.template\.txt: .*placeholder \{question\}"),
    ("Review.template.txt", "Judge {solution}", r"Review\.template\.txt: .*never uses \['\{question\}'\]"),
    ("policy.txt", "{operators} {question}", r"policy\.txt must use exactly .* missing \['max_calls'\]"),
    ("ScEnsemble.template.txt", "Pick {query", r"ScEnsemble\.template\.txt: .*not a valid str\.format template"),
    ("answergenerate.template.txt", "{input}", r"answergenerate\.template\.txt is not a prompt file"),
    ("Search.template.txt", "{input}", r"Search\.template\.txt is not a prompt file"),
    ("Custom.description.txt", "\n", r"Custom\.description\.txt is empty"),
])
def test_a_bad_set_is_one_line_naming_the_file(tmp_path, filename, text, message):
    (tmp_path / filename).write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        EnvConfig(prompt_set=str(tmp_path))
    assert "\n" not in str(err.value) and str(tmp_path) in str(err.value)


def test_an_unknown_set_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"neither a built-in set \['faithful', 'concise', 'local', 'local_search'\] nor a directory"):
        EnvConfig(prompt_set=str(tmp_path / "nope"))


def test_executor_runs_the_set_as_default_and_per_call(tmp_path):
    (tmp_path / "AnswerGenerate.template.txt").write_text("PIRATE VOICE please: {input} <think> <answer>")
    # The server's own set (a call without a template) ...
    with start_in_thread(FakeBackend(), config=ServerConfig(prompt_set=str(tmp_path))) as handle, \
            ExecutorClient(handle.url, timeout_s=30) as client:
        (own,) = client.execute_many_sync([("AnswerGenerate", "Who wrote Hamlet?")])
    # ... and a default server given the trainer's set with every call.
    templates = EnvConfig(prompt_set=str(tmp_path)).operator_templates()
    with start_in_thread(FakeBackend()) as handle, ExecutorClient(handle.url, timeout_s=30) as client:
        sent, default = client.execute_many_sync([("AnswerGenerate", "Who?")], templates=templates) + \
            client.execute_many_sync([("AnswerGenerate", "Who?")])
    # FakeBackend quotes the prompt it was sent in its <think>.
    assert "PIRATE VOICE please: Who wrote Hamlet?" in own.text and "PIRATE VOICE please: Who?" in sent.text
    assert "PIRATE" not in default.text and "Work through the task below step by step" in default.text


def test_command_line_executor_rejects_a_bad_prompt_set_in_one_line(tmp_path):
    (tmp_path / "Revise.template.txt").write_text("Fix {solution} using {feedback}")
    out = subprocess.run([sys.executable, "-m", "workflow_r1.executor", "--prompt_set", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode != 0 and "Revise.template.txt" in out.stderr and "{question}" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------------
# Search in the paper preset


def test_snippet_cuts_at_a_word_boundary():
    assert snippet("short  text\nhere", 40) == "short text here"
    assert snippet("The Seine flows through Paris, France.", 24) == "The Seine flows..."
    assert snippet("The Seine flows through Paris, France.", 33) == "The Seine flows through Paris..."  # no ", "
    assert snippet("Supercalifragilistic", 10) == "Superca..."  # one long word: cut inside it
    assert len(snippet("word " * 100, 160)) <= 160


def test_paper_preset_search_renders_five_title_and_snippet_results():
    ex = base.get_config("paper").executor
    assert (ex.search_topk, ex.search_snippet_chars) == (5, 160)
    assert base.get_config("local").executor.search_snippet_chars == 0  # full passages there
    runner = OperatorRunner(None, BM25Search(), search_topk=ex.search_topk, search_snippet_chars=ex.search_snippet_chars)
    text = asyncio.run(runner.run("Search", "river that flows through Paris")).text
    header, *blocks = text.split("\n\n")
    assert header == "Search results for 'river that flows through Paris':" and len(blocks) == 5
    corpus = {p.title: p.text for p in runner.search.passages}
    for block in blocks:
        title, snip = re.fullmatch(r"Title: (.*)\nSnippet: (.*)", block).groups()
        full = " ".join(corpus[title].split())
        assert len(snip) <= 160 and (snip == full or (snip.endswith("...") and full.startswith(snip[:-3])))
    assert len(text) < 2048  # five snippets fit the observation limit, uncut


def test_render_full_text_is_unchanged_by_default():
    passages = [Passage("A", "alpha " * 100)]
    assert render_results("q", passages) == render_results("q", passages, 0)
    assert "Text: " + "alpha " * 99 + "alpha" in render_results("q", passages)


# ------------------------------------------------------------------------------------------------
# The reward's WarningOp quirk and per-operator observation statistics


def _episode(turns: list[Turn], response_text: str, gold: str = "Paris") -> Episode:
    ep = Episode(question=Question(id="q", question="Q?", golden_answers=(gold,), data_source="t"),
                 group=0, sample=0, messages=[], prompt_ids=[], turns=turns)
    score = reward.compute_reward(response_text, ep.question.golden_answers, [t.text for t in turns])
    ep.reward, ep.reward_format, ep.reward_outcome, ep.answer_source = (score.total, score.format, score.outcome,
                                                                          score.answer_source)
    return ep


def _obs(text: str) -> str:
    return f"<tool_response>\n<info>{text}</info>\n</tool_response>"


def test_warning_answers_are_counted_in_the_reward_breakdown():
    warn = Turn("no tags", "warning", "WarningOp", observation=WARNING_TEXT)
    never = _episode([warn, warn], "no tags" + _obs(WARNING_TEXT) + "no tags" + _obs(WARNING_TEXT))
    assert (never.reward, never.answer_source) == (-0.5, "warning")  # the quirk, kept: not -1.5
    answered = _episode([warn, Turn("<answer>Paris</answer>", "answer", None)],
                        "no tags" + _obs(WARNING_TEXT) + "<answer>Paris</answer>")
    assert (answered.reward, answered.answer_source) == (0.5, "policy")
    raw = "AnswerGenerate said <answer>Paris</answer>"
    leaked = _episode([Turn("<tool>AnswerGenerate: q</tool>", "tool", "AnswerGenerate", observation=raw)],
                      "<tool>AnswerGenerate: q</tool>" + _obs(raw))
    assert (leaked.reward, leaked.answer_source) == (0.5, "observation")
    silent = _episode([Turn("<think>hm</think>", "warning", "WarningOp")], "<think>hm</think>")
    assert (silent.reward, silent.answer_source) == (-1.5, "none")
    m = episode_metrics([never, answered, leaked, silent])
    assert m["answer_from_warning"] == 0.25 and m["answer_from_observation"] == 0.5
    assert reward.compute_reward("x", ["y"]).answer_source == ""  # without the turns: not classified


def test_observation_length_and_truncation_rate_per_operator():
    turns = [Turn("t", "tool", "Search", observation="s" * 3000, truncated_observation=True),
             Turn("t", "tool", "Search", observation="s" * 1000),
             Turn("t", "tool", "Review", observation="r" * 10),
             Turn("t", "tool", "Review", observation=None)]  # cut off by a cap: nothing returned
    m = episode_metrics([_episode(turns[:2], ""), _episode(turns[2:], "")])
    assert (m["obs_chars/Search"], m["obs_truncated/Search"]) == (2000.0, 0.5)
    assert (m["obs_chars/Review"], m["obs_truncated/Review"]) == (10.0, 0.0)
    assert not any(k.endswith("/WarningOp") for k in m)
