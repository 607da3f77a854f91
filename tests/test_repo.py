"""The README's commands and CI stay in sync; modules stay readable in one sitting."""

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


# One idea per module: a file past this many lines is two ideas (docs/design.md, Layout).
MAX_MODULE_LINES = 500


def test_no_module_is_over_the_size_limit():
    packages = [ROOT / "workflow_r1", ROOT / "rlmopt", ROOT / "configs", ROOT / "benchmarks", ROOT / "launch"]
    long = {str(p.relative_to(ROOT)): n for pkg in packages for p in sorted(pkg.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split each by idea): {long}"
