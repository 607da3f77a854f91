"""Deterministic fakes for the rlmopt tests: a two-field toy task whose fake task LM reads its
behaviour from directives in the prompt, so a test can dial each field's score per example."""
from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

from rlmopt.config import RLMOptConfig
from rlmopt.harness import Harness
from rlmopt.lm import FunctionLM
from rlmopt.task import Example, Field, Task


def toy_task(n: int = 100, split_sizes=(20, 40, 40), seed_prompt: str = "Answer for {x}.") -> Task:
    """Item k: inputs {"x": "item k"}, gold {"a": "A<k>", "b": "B<k>"}; two exact-match fields."""
    examples = [Example(f"e{k:03d}", {"x": f"item {k}"}, {"a": f"A{k}", "b": f"B{k}"})
                for k in range(n)]
    return Task("toy", "two fields a and b", examples,
                [Field("a", "exact_match"), Field("b", "exact_match")],
                {"system_prompt": seed_prompt}, max_tokens=16, split_sizes=split_sizes)


def _toy_reply(prompt: str) -> str:
    """Directives in the prompt: `A<K` -> field a right for items k < K (likewise `B<K`);
    `A%M` -> a right for items with k % M == 0; `A=3,17` -> a right for items 3 and 17;
    `A!3,17` -> a right for every item but 3 and 17 (the last two dial single examples)."""
    k = int(re.search(r"item (\d+)", prompt).group(1))

    def right(letter: str) -> bool:
        lt = re.search(letter + r"<(\d+)", prompt)
        mod = re.search(letter + r"%(\d+)", prompt)
        listed = re.search(letter + r"([=!])(\d+(?:,\d+)*)", prompt)
        if listed:
            return (str(k) in listed.group(2).split(",")) == (listed.group(1) == "=")
        return bool((lt and k < int(lt.group(1))) or (mod and k % int(mod.group(1)) == 0))

    return json.dumps({"a": f"A{k}" if right("A") else "?", "b": f"B{k}" if right("B") else "?"})


def toy_items(h: Harness, ids) -> str:
    """The toy items of example ids, as a directive's list: ["e003", "e017"] -> "3,17"."""
    return ",".join(str(int(h.examples[i].inputs["x"].split()[1])) for i in ids)


def sealed_patterns(h: Harness) -> list[re.Pattern]:
    """What must never reach the optimizer: every test example's id, input and golds."""
    return [re.compile(rf"\b{re.escape(text)}\b") for e in h.splits.test
            for text in (e.id, e.inputs["x"], e.expected["a"], e.expected["b"])]


def toy_lm() -> FunctionLM:
    return FunctionLM(_toy_reply)


def toy_harness(budget: int = 1000, task: Task | None = None, sub_lm=None, run_dir=None,
                **cfg) -> Harness:
    return Harness(task or toy_task(), toy_lm(), RLMOptConfig(budget=budget, **cfg),
                   sub_lm=sub_lm, run_dir=run_dir)


def run_compare(tmp_path: pathlib.Path, task: str, budget: int, task_lm: str,
                extra: tuple[str, ...] = ()) -> str:
    """`python -m rlmopt.compare` on 9 questions, rlmopt + gepa + baseline, one seed, scripted
    optimizers, plus the flags `extra`; asserts it exits 0 and returns the Markdown table it wrote."""
    out = subprocess.run(
        [sys.executable, "-m", "rlmopt.compare", f"--task={task}", "--questions=9",
         "--methods=rlmopt,gepa,baseline", "--seeds=1", f"--budget={budget}", f"--task_lm={task_lm}",
         "--optimizer_lm=scripted", f"--run_root={tmp_path}", f"--out={tmp_path / 't.md'}", *extra],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return (tmp_path / "t.md").read_text()
