"""Multi-hop QA over supporting paragraphs, in HotpotQA's distractor-setting format.

Point it at your own file: `--task=multihop_qa:FILE` (default: the small bundled set,
`tasks/data/multihop_qa.json`, written for this project about invented places and people). FILE is
a JSON list (HotpotQA's own files) or a .jsonl file of records:

    {"_id": "...", "question": "...", "answer": "...",
     "context": [[title, [sentence, ...]], ...],          # supporting + distractor paragraphs
     "supporting_facts": [[title, sentence index], ...]}  # optional; used by the simulated reader

The task LM sees the candidate with `{context}` (the paragraphs, "Title: sentences", one per
blank-line-separated block) and `{question}` filled; its answer is the text after the last
"Answer:" in the reply, else the reply's first non-empty line. Fields: `answer_em` (0.5, exact
match after SQuAD normalisation) and `answer_f1` (0.5, token F1).

`simulated_reader` is a deterministic stand-in task LM for tests: it answers only when every
supporting paragraph is in its prompt, and with the bare answer only when the prompt asks for the
"short answer" (else a hedged sentence: no exact match, partial F1).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

from rlmopt.lm import FunctionLM
from rlmopt.metrics import exact_match, token_f1
from rlmopt.task import Example, Field, Task

BUNDLED = Path(__file__).with_name("data") / "multihop_qa.json"
FIELDS = (Field("answer_em", "exact_match", 0.5), Field("answer_f1", "token_f1", 0.5))
SEED_PROMPT = "Use the paragraphs to answer the question.\n\n{context}\n\nQuestion: {question}\nAnswer:"
KEYWORD = "short answer"


def paragraphs(context: list) -> str:
    """HotpotQA's context ([[title, [sentences]], ...]) as "Title: sentences" blocks."""
    return "\n\n".join(f"{title}: {' '.join(s.strip() for s in sents)}" for title, sents in context)


def _records(path: Path) -> list[dict]:
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of HotpotQA records (or a .jsonl file)")
    return data


class MultiHopTask(Task):
    """A Task whose answer is read from the reply's "Answer:" line (see the module docstring)."""

    def parse(self, reply: str) -> dict[str, Any]:
        text = reply.strip()
        at = [m.end() for m in re.finditer(r"answer\s*:", text, re.I)]
        if at:
            text = text[at[-1]:]
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        answer = lines[0] if lines else ""
        return {"answer_em": answer, "answer_f1": answer}

    def score(self, prediction: Mapping[str, Any], example: Example) -> dict[str, float]:
        gold = example.expected["answer_em"]
        answer = prediction.get("answer_em", "")
        return {"answer_em": exact_match(answer, gold), "answer_f1": token_f1(answer, gold)}


def build(path: str = "") -> MultiHopTask:
    """The task over the records in `path` (default: the bundled set)."""
    file = Path(path) if path else BUNDLED
    try:
        records = _records(file)
    except (OSError, ValueError) as exc:
        raise ValueError(f"multihop_qa file {file}: cannot read it ({exc})") from None
    examples = []
    for n, r in enumerate(records):
        missing = [k for k in ("question", "answer", "context") if k not in r]
        if missing:
            raise ValueError(f"{file} record {n + 1}: missing {missing} (HotpotQA format: question, "
                             "answer, context [[title, [sentences]]])")
        titles = sorted({t for t, _ in r.get("supporting_facts", [])})
        examples.append(Example(str(r.get("_id", f"mh{n:05d}")),
                                {"question": r["question"], "context": paragraphs(r["context"])},
                                {"answer_em": r["answer"], "answer_f1": r["answer"],
                                 "supporting_titles": titles}))
    return MultiHopTask(
        name="multihop_qa",
        description=("Answer a multi-hop question from the given paragraphs (some are "
                     "distractors): the answer needs facts from two or more of them. The reply's "
                     "answer is the text after its last 'Answer:' (else its first line), scored "
                     "by exact match and token F1 against the gold answer. Keep {context} and "
                     "{question} in the prompt."),
        examples=examples, fields=list(FIELDS), seed_candidate={"system_prompt": SEED_PROMPT},
        max_tokens=48)


def _reader(task: MultiHopTask):
    by_question = {e.inputs["question"]: e for e in task.examples}

    def reply(prompt: str) -> str:
        ex = next((e for q, e in by_question.items() if q in prompt), None)
        if ex is None:
            return "I do not know."
        blocks = {b.split(":", 1)[0]: b for b in ex.inputs["context"].split("\n\n")}
        if not all(blocks.get(t, "\0") in prompt for t in ex.expected["supporting_titles"]):
            return "The paragraphs do not say."
        answer = ex.expected["answer_em"]
        if KEYWORD in prompt.lower():
            return answer
        return f"Based on the paragraphs, I believe it is {answer}, as far as I can tell."
    return reply


def simulated_reader(task: MultiHopTask) -> FunctionLM:
    """The deterministic stand-in task LM (see the module docstring)."""
    return FunctionLM(_reader(task))
