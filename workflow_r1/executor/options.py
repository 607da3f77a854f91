"""Every setting of an executor, as two dataclasses; the command line is generated from them.

- `ServerConfig`: the service's limits and the operators' settings (the LLM's decoding budget per
  attempt `max_tokens`, the repair loop's `max_attempts`, Search's passages and snippets, the
  prompt set). An embedded executor (`connect.connect`) builds one from the trainer's `executor`
  config section.
- `ProcessConfig`: what only `python -m workflow_r1.executor` has: the address, the backend specs
  and their clients' settings, the bearer token's file, shutdown and the event loop.

`define_flags` makes one absl flag per field of both (`dataclass_flags`: name, type, default and
help from the field and the class docstring; `token` is read from `--token_file`, never typed), so
adding a field adds a flag. `--topk` is the older name of `--search_topk`. Every numeric field has
its range in the class's RANGES (`ranges.Range`); `flag_errors` reports each flag outside its range
in one line before anything starts, and the dataclasses refuse such values when built in code.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import ClassVar, Literal

from absl import flags

from workflow_r1 import dataclass_flags
from workflow_r1.task import prompt_sets
from workflow_r1.executor.guard import load_token
from workflow_r1.executor.httpio import UPSTREAM_REPLY_BYTES
from workflow_r1.executor.ranges import COUNT, SECONDS, Range, range_errors

flags.disclaim_key_flags()  # the flags defined here belong to the entry point that asks for them


@dataclass
class ServerConfig:
    """Limits and operator settings of one executor.

    max_content_chars: longest call `content` (and `template`) accepted, characters; longer -> 413.
    max_prompt_chars: longest executor-LLM prompt a call may render, characters, counted before
        formatting (template text plus each placeholder's value); longer -> 413. It stops a short
        template that repeats `{input}` thousands of times from building a gigabyte prompt.
    max_body_bytes: longest request body, bytes; longer -> 413.
    max_batch: most calls in one /execute_batch request.
    max_inflight: most operator calls running at once; a request that would exceed it gets 503
        with Retry-After (the client waits and retries within its timeout).
    op_timeout_s: wall-clock limit on one operator call, seconds; past it the reply is an error
        observation with error_kind "timeout".
    read_timeout_s: limit on receiving one request body, seconds; past it -> 408.
    idle_timeout_s: a connection with no complete request for this long is closed, seconds (idle
        keep-alive connections, and ones that never finish sending their headers).
    header_timeout_s: a request's headers must be complete this long after their first byte,
        seconds; else the connection is closed.
    max_connections: most open connections (lowered to 3/4 of the open-file limit, whose soft
        value is first raised to the hard one); at the cap a new connection closes the one quiet
        longest if it has been quiet for evict_idle_s, else gets 503 with Retry-After
        (connections.py).
    evict_idle_s: how long a connection must have been quiet (idle since its last reply, or
        stalled in one request) before a newcomer at max_connections may close it, seconds.
        Shorter: held sockets make room sooner; longer: a client's pooled keep-alive connection
        is less often closed just as it is reused (ExecutorClient retries that call once).
    token: bearer token required on every endpoint but GET /health ("" = none; see guard.py).
    max_tokens: the executor LLM's generation limit per attempt, tokens (the paper's 1024).
    max_attempts: attempts of an LLM operator's repair loop: a reply cut off or missing a
        required tag is asked for again, up to this many calls in all (the paper's 3).
    search_topk: passages per Search call.
    search_snippet_chars: cut each Search passage to a snippet of at most this many characters
        ("Title / Snippet" blocks, the paper preset's 160); 0: the full text ("Title / Text").
    prompt_set: the executor prompts of calls that send no template: faithful | concise | a
        directory of prompt files (`task.prompt_sets`; docs/paper.md, Prompt sets).
    """

    max_content_chars: int = 65_536
    max_prompt_chars: int = 262_144
    max_body_bytes: int = 8 * 1024 * 1024
    max_batch: int = 512
    max_inflight: int = 1024
    op_timeout_s: float = 1800.0
    read_timeout_s: float = 30.0
    idle_timeout_s: float = 75.0
    header_timeout_s: float = 10.0
    max_connections: int = 4096
    evict_idle_s: float = 5.0
    token: str = dataclasses.field(default="", repr=False)
    max_tokens: int = 1024
    max_attempts: int = 3
    search_topk: int = 3
    search_snippet_chars: int = 0
    prompt_set: str = prompt_sets.DEFAULT

    RANGES: ClassVar[dict[str, Range]] = {
        "max_content_chars": COUNT, "max_prompt_chars": COUNT, "max_body_bytes": COUNT,
        "max_batch": COUNT, "max_inflight": COUNT, "op_timeout_s": SECONDS,
        "read_timeout_s": SECONDS, "idle_timeout_s": SECONDS, "header_timeout_s": SECONDS,
        "max_connections": COUNT, "evict_idle_s": SECONDS, "max_tokens": COUNT,
        "max_attempts": COUNT, "search_topk": COUNT, "search_snippet_chars": Range(0, integer=True),
    }

    def __post_init__(self):
        errors = range_errors(dataclasses.asdict(self), self.RANGES)
        if errors:
            raise ValueError("ServerConfig: " + "; ".join(errors))


@dataclass(frozen=True)
class ProcessConfig:
    """How `python -m workflow_r1.executor` runs: its address, backends, token and shutdown.

    host: bind address.
    port: port; 0 picks a free one.
    llm: executor LLM: fake | openai:URL (openai alone: $OPERATOR_BASE_URL) | local |
        local:CHECKPOINT_DIR (a path or a URI: local:gs://bucket/model; local alone: the bundled model).
    api_key: API key of the OpenAI-compatible server; empty: $OPERATOR_API_KEY.
    model: model name sent to the OpenAI-compatible server (default $OPERATOR_MODEL_NAME, else
        "default").
    llm_timeout_s: per HTTP attempt to the LLM, seconds.
    llm_retries: retries of a failed LLM HTTP request.
    llm_concurrency: LLM requests in flight at once.
    local_max_batch: most prompts the local backend generates together.
    local_max_wait_ms: how long the local backend waits to fill a batch, ms.
    local_dtype: weight and compute dtype of a local model.
    fake_delay_s: simulated fake-LLM latency, seconds.
    search: Search: bm25 | bm25:CORPUS.jsonl | remote:URL | none.
    search_timeout_s: per request to a remote retrieval server, seconds (time queued for a
        connection not included).
    max_reply_bytes: longest reply read from the LLM or the retrieval server, bytes; a longer one
        is an error.
    token_file: file holding the bearer token callers must send; empty: $WORKFLOW_R1_EXECUTOR_TOKEN,
        if set (else no token).
    shutdown_timeout_s: on SIGTERM, how long to let calls in flight finish, seconds.
    loop: event loop; auto uses uvloop when installed (about 1.5x the calls/s).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    llm: str = "fake"
    # The key's default is read when the backend is built, never here, so --help never prints it.
    api_key: str = dataclasses.field(default="", repr=False)
    model: str = dataclasses.field(default_factory=lambda: os.environ.get("OPERATOR_MODEL_NAME", "default"))
    llm_timeout_s: float = 600.0
    llm_retries: int = 2
    llm_concurrency: int = 256
    local_max_batch: int = 32
    local_max_wait_ms: float = 5.0
    local_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    fake_delay_s: float = 0.0
    search: str = "bm25"
    search_timeout_s: float = 30.0
    max_reply_bytes: int = UPSTREAM_REPLY_BYTES
    token_file: str = ""
    shutdown_timeout_s: float = 30.0
    loop: Literal["auto", "uvloop", "asyncio"] = "auto"

    RANGES: ClassVar[dict[str, Range]] = {
        "port": Range(0, 65535, integer=True),
        "llm_timeout_s": SECONDS,
        "llm_retries": Range(0, 100, integer=True),
        "llm_concurrency": COUNT,
        "local_max_batch": COUNT,
        "local_max_wait_ms": Range(0),
        "fake_delay_s": Range(0),
        "search_timeout_s": SECONDS,
        "max_reply_bytes": COUNT,
        "shutdown_timeout_s": Range(0),
    }

    def __post_init__(self):
        errors = range_errors(dataclasses.asdict(self), self.RANGES)
        if errors:
            raise ValueError("ProcessConfig: " + "; ".join(errors))

    def llm_api_key(self) -> str:
        """`api_key`, or $OPERATOR_API_KEY when it is empty."""
        return self.api_key or os.environ.get("OPERATOR_API_KEY", "")


# Fields that are no flag: the token is read from --token_file (or $WORKFLOW_R1_EXECUTOR_TOKEN).
NOT_FLAGS = ("token",)
# Older flag names kept working: old name -> field.
OLD_NAMES = {"topk": "search_topk"}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> dict[str, flags.FlagHolder]:
    """One flag per field of ServerConfig (but NOT_FLAGS) and ProcessConfig, and the OLD_NAMES
    aliases, on `flag_values`; returns field name -> FlagHolder."""
    holders = {**dataclass_flags.define(ServerConfig, flag_values, exclude=NOT_FLAGS),
               **dataclass_flags.define(ProcessConfig, flag_values)}
    for old, field in OLD_NAMES.items():
        flags.DEFINE_alias(old, field, flag_values=flag_values)
    return holders


def flag_errors(holders: dict[str, flags.FlagHolder], flag_values: flags.FlagValues = flags.FLAGS) -> list[str]:
    """One line per numeric flag outside its range, "--name=value: must be ...", named as it was
    given (`--topk` when the older name was used); empty when all are valid."""
    given = {field: old for old, field in OLD_NAMES.items() if old in flag_values and flag_values[old].present}
    ranges = {**ServerConfig.RANGES, **ProcessConfig.RANGES}
    values = {given.get(n, n): h.value for n, h in holders.items() if n in ranges}
    return range_errors(values, {given.get(n, n): r for n, r in ranges.items()}, prefix="--")


def from_flags(holders: dict[str, flags.FlagHolder]) -> tuple[ServerConfig, ProcessConfig]:
    """The parsed flags as (ServerConfig with the bearer token of --token_file or the environment,
    ProcessConfig). ValueError (one line) for a value out of range or an unreadable token file."""
    process = ProcessConfig(**dataclass_flags.values(ProcessConfig, holders))
    server = ServerConfig(token=load_token(process.token_file), **dataclass_flags.values(ServerConfig, holders))
    return server, process
