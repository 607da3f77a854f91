"""`task.tags` gives the results of the regex `<tag>(.*?)</tag>` (DOTALL) in linear time."""
import os
import random
import re
import subprocess
import sys
from pathlib import Path

from workflow_r1.task.tags import all_tags, first_block, first_tag, last_tag

REPO = Path(__file__).resolve().parent.parent


def _reference(text: str, tag: str) -> list[re.Match]:
    return list(re.finditer(rf"<{tag}>(.*?)</{tag}>", text, re.DOTALL))


def test_same_results_as_the_regex_on_random_texts():
    rng = random.Random(7)
    pieces = ["<a>", "</a>", "<b>", "</b>", "<a", "a>", "</", "x", " ", "\n", "<a></a>", "<<a>>"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 14)))
        for tag in ("a", "b"):
            matches = _reference(text, tag)
            assert all_tags(text, tag) == [m.group(1).strip() for m in matches], text
            assert first_tag(text, tag) == (matches[0].group(1).strip() if matches else None), text
            assert last_tag(text, tag) == (matches[-1].group(1).strip() if matches else None), text
            block = first_block(text, tag)
            expected = (matches[0].start(), matches[0].end(), matches[0].group(1)) if matches else None
            assert (block and (block.start, block.end, block.inner)) == expected, text


def test_unclosed_tags_take_linear_time():
    # The regex needs ~10^11 steps on these texts (every unclosed <task> rescans the rest: many
    # minutes, in C code that no test timeout can interrupt, hence the subprocess); the linear
    # scan takes milliseconds.
    code = """if True:
        from workflow_r1.task.tags import all_tags, first_tag, last_tag
        text = "<task>" * 300_000 + "</tas"
        assert first_tag(text, "task") is None
        assert all_tags(text, "task") == [] and last_tag(text, "task") is None
        closed = "<task>" * 300_000 + "x</task>" + "<task>" * 300_000
        assert all_tags(closed, "task") == ["<task>" * 299_999 + "x"]
    """
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
