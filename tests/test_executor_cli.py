"""The executor's command line is generated from its settings dataclasses (executor/options.py,
dataclass_flags.py): every field is a flag with the field's type, default and documented help, a
field added is a flag added, the older `--topk` still works, and the operator LLM's decoding budget
(`--max_tokens`) and repair attempts (`--max_attempts`) reach the operators of a real
`python -m workflow_r1.executor` process."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
from absl import flags
from aiohttp import web

from workflow_r1 import dataclass_flags
from workflow_r1.executor import ExecutorClient
from workflow_r1.executor.connect import ExecutorConfig
from workflow_r1.executor.options import (NOT_FLAGS, OLD_NAMES, ProcessConfig, ServerConfig, define_flags,
                                          flag_errors, from_flags)
from workflow_r1.executor.server import serve_app_in_thread

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parent.parent


def _parsed(*args: str) -> tuple[flags.FlagValues, dict]:
    fv = flags.FlagValues()
    holders = define_flags(fv)
    fv(["prog", *args])
    return fv, holders


def test_the_flags_are_the_dataclass_fields_with_their_defaults():
    fv = flags.FlagValues()
    holders = define_flags(fv)
    fields = {f.name for f in dataclasses.fields(ServerConfig)} - set(NOT_FLAGS) | \
        {f.name for f in dataclasses.fields(ProcessConfig)}
    assert set(holders) == fields and set(fv) == fields | set(OLD_NAMES)
    assert {"max_tokens", "max_attempts", "search_topk", "port", "llm", "token_file"} <= fields
    defaults = {**dataclasses.asdict(ServerConfig()), **dataclasses.asdict(ProcessConfig())}
    for name, holder in holders.items():
        assert fv[name].default == defaults[name], name
        assert fv[name].help and not fv[name].help.startswith("see "), name
    assert fv["local_dtype"].parser.enum_values == ["bfloat16", "float32"]
    assert fv["topk"].help == "Alias for --search_topk."
    # The trainer's embedded executor shares the operators' defaults with the service.
    assert (ExecutorConfig().max_tokens, ExecutorConfig().max_attempts) == (1024, 3) == \
        (ServerConfig.max_tokens, ServerConfig.max_attempts)


def test_a_field_added_to_the_dataclass_is_a_flag():
    @dataclasses.dataclass(frozen=True)
    class Extended(ProcessConfig):
        """The process, and two knobs.

        new_knob: a knob that did not exist; its help may run
            over two lines.
        rate, mode: two fields documented together.
        """

        new_knob: int = 7
        rate: float = 2
        mode: Literal["a", "b"] = "b"

    fv = flags.FlagValues()
    holders = dataclass_flags.define(Extended, fv)
    assert set(holders) == {f.name for f in dataclasses.fields(Extended)}
    assert (fv["new_knob"].default, fv["new_knob"].help) == (7, "a knob that did not exist; its help may run over "
                                                                 "two lines.")
    assert fv["rate"].default == 2.0 and fv["rate"].help == "two fields documented together."
    assert fv["mode"].help == "<a|b>: two fields documented together."  # absl names an enum's choices
    fv(["prog", "--new_knob=9", "--mode=a", "--rate=0.5"])
    built = Extended(**dataclass_flags.values(Extended, holders))
    assert (built.new_knob, built.mode, built.rate, built.port) == (9, "a", 0.5, 8000)

    @dataclasses.dataclass
    class Undocumented(ServerConfig):
        secret_knob: int = 1

    with pytest.raises(TypeError, match="secret_knob has no help"):
        dataclass_flags.define(Undocumented, flags.FlagValues(), exclude=NOT_FLAGS)


def test_flags_build_the_configs_and_old_names_and_ranges_are_kept(monkeypatch):
    monkeypatch.setenv("WORKFLOW_R1_EXECUTOR_TOKEN", "s3cret")
    fv, holders = _parsed("--topk=2", "--max_tokens=64", "--max_attempts=1", "--port=0", "--llm_retries=5")
    assert not flag_errors(holders, fv)
    server, process = from_flags(holders)
    assert (server.search_topk, server.max_tokens, server.max_attempts, server.token) == (2, 64, 1, "s3cret")
    assert (process.port, process.llm_retries, process.llm) == (0, 5, "fake")
    fv, holders = _parsed("--topk=0", "--max_tokens=0", "--max_attempts=-1", "--port=70000")
    assert sorted(flag_errors(holders, fv)) == ["--max_attempts=-1: must be an integer >= 1",
                                                "--max_tokens=0: must be an integer >= 1",
                                                "--port=70000: must be an integer in [0, 65535]",
                                                "--topk=0: must be an integer >= 1"]
    fv, holders = _parsed("--search_topk=0")
    assert flag_errors(holders, fv) == ["--search_topk=0: must be an integer >= 1"]


def test_environment_fallbacks(monkeypatch):
    monkeypatch.setenv("OPERATOR_MODEL_NAME", "qwen-from-env")
    monkeypatch.setenv("OPERATOR_API_KEY", "sk-env")
    fv = flags.FlagValues()
    define_flags(fv)
    assert fv["model"].default == "qwen-from-env" and fv["api_key"].default == ""  # --help shows no key
    assert ProcessConfig().llm_api_key() == "sk-env" and ProcessConfig(api_key="sk-flag").llm_api_key() == "sk-flag"


class _Untagged:
    """A chat-completions server that always answers without the required tags (so every operator
    call runs its whole repair loop) and records the requests."""

    def __init__(self):
        self.requests: list[dict] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append(await request.json())
        return web.json_response({"choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": "It is 42."}}],
                                  "usage": {"completion_tokens": 3}})


def test_max_tokens_and_max_attempts_reach_the_operators():
    upstream = _Untagged()
    with serve_app_in_thread(upstream.app) as llm:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workflow_r1.executor", "--port=0", f"--llm=openai:{llm.url}/v1",
             "--search=none", "--max_tokens=77", "--max_attempts=2", "--loop=asyncio"],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        try:
            line = proc.stdout.readline()
            assert "listening on http://127.0.0.1:" in line, line + proc.stdout.read()
            url = line.split("listening on ")[1].split()[0]
            with ExecutorClient(url, timeout_s=30) as client:
                [obs] = client.execute_many_sync([("AnswerGenerate", "What is 6 * 7?")])
        finally:
            proc.terminate()
            proc.wait(10)
    assert obs.llm_calls == 2 and len(upstream.requests) == 2  # the repair loop stopped at 2 attempts
    assert [r["max_tokens"] for r in upstream.requests] == [77, 77]
