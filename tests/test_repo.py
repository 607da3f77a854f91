"""The README's commands and CI stay in sync."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_ci_runs_exactly_the_readme_test_command():
    install, test = _readme_commands()[:2]
    assert "pytest" in test
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in ci_lines, f"README test command {test!r} is not a line of .ci/run"


def test_readme_first_command_exists():
    install = _readme_commands()[0]
    script = install.split()[-1]
    assert (ROOT / script).exists(), script
