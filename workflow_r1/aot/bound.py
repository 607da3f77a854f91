"""The whole-step time bound: every row of a host rolled out, the sampler's weight sync, the
reference scoring and the update, each priced from its compiled program (`workflow_r1.aot`).

A training step on a host: the sampler's weights are brought up to date from the train state
(`sync`), the engine rolls out all of the host's rows, `rows_in_flight` per call (`prefill`,
`decode`, and `view`: the copy of the call's rows from the page pool into the dense working cache
the programs run on), then the slice scores the reference log-probs (`score`) and runs the update
(`update`, the old log-probs included). Hosts roll out in parallel, so the rollout is one host's.
Parts run one after another and add up.

Each part is a lower bound of its time on the chips, from the per-call figures of a `Report`
(per device: the flops it executes, the weight and cache bytes it must read, the weight shards
it must gather): a call takes at least max(flops / peak, bytes / HBM bandwidth, gathered bytes /
ICI bandwidth). The workload (`Workload`) says how many calls:

  prompt   tokens computed after prefix caching (whole pages are shared: the template every
           prompt starts with once per host, the rest of a group's prompt once per group, and
           each row's last partial page, whose last token is always fed, for every row);
  response `response_tokens` per row, of which `observation_tokens` are prefilled and the rest
           decoded, one token per row per decode step, every call full (`rows_in_flight` rows);
  context  the cache a call reads is its rows' mean context (prompt + half the response), not
           the compiled longest row's: attention flops and cache bytes scale by that fraction;
  calls    an engine call decodes at most `decode_burst` tokens per row and every row needs one,
           so calls = max(rows / rows_in_flight, decode steps / decode_burst), each with one
           prefill (reading the weights once) and one view (none when the call attends over
           the pages in place: rollout.paged_attention "kernel", the default on TPU).
  steps    with ragged engine steps (rollout.max_tokens_per_step = N > 0, the `step` program)
           the rollout is those steps instead of calls: every prompt, observation and decoded
           token once, at most N a step and at most one decoded token per row in flight a step,
           so steps = max(tokens / N, decode steps); each reads the weights once and the KV of
           its rows (at most one per token, at most rows_in_flight) at the mean context.

The sync, when the sampler's weights are not the train state's own arrays, is its compiled
program (`sync`, aot/sampler.py) at its roofline, once a step: the bytes its collectives deliver
each chip over the chip's ICI links (`Chip.ici_bandwidth`), or its weight shards read and its copy
written over the HBM bandwidth, whichever is slower.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class Workload:
    """One host's rollout per step. Tokens are per row unless named otherwise."""

    rows: int  # the host's rows per step: prompts_per_step * n / hosts
    group: int  # rows per prompt (rollout.n): they share the whole prompt
    rows_in_flight: int  # rows of one engine call, as compiled
    prompt_tokens: int  # opening prompt (mean)
    template_tokens: int  # the prefix every prompt shares
    response_tokens: float  # everything after the prompt (mean): generated + observations
    observation_tokens: float  # of the response, inserted by the environment (prefilled)
    page_size: int  # the prefix cache shares whole pages only
    decode_burst: int  # most tokens a row decodes per engine call
    prefill_chunk: int  # tokens per row of one compiled prefill call
    cache_length: int  # slots per row of the compiled working cache
    view: bool = True  # calls copy their rows' pages into a dense working cache (rollout.paged_attention)
    max_tokens_per_step: int = 0  # N > 0: ragged engine steps of at most N tokens, not calls
    step_tokens: int = 0  # the compiled step's flat run (N rounded up to a power of two)
    kv_bytes_per_token: int = 0  # a token's K and V over all layers, per device (ragged steps' KV reads)


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    calls: float
    seconds: float  # all calls of a step
    note: str


def prompt_tokens_computed(w: Workload) -> tuple[int, int, int, int]:
    """(once per host, once per group, once per row, the host's total): prompt tokens the prefill
    computes after prefix caching. A page is shared when it is whole and not the page of the
    prompt's last token (always fed: its logits are sampled from)."""
    cached = w.page_size * ((w.prompt_tokens - 1) // w.page_size)  # shareable pages of a prompt
    shared = min(w.page_size * (w.template_tokens // w.page_size), cached)
    per_group = cached - shared
    per_row = w.prompt_tokens - cached
    total = shared + -(-w.rows // w.group) * per_group + w.rows * per_row
    return shared, per_group, per_row, total


def rollout_counts(w: Workload) -> dict[str, float]:
    """A host's prefill tokens, decode steps and engine calls per step, and the mean context's
    share of the compiled cache."""
    generated = w.response_tokens - w.observation_tokens
    prompt = prompt_tokens_computed(w)[3]
    steps = w.rows * generated / w.rows_in_flight
    calls = max(math.ceil(w.rows / w.rows_in_flight), steps / w.decode_burst)
    context = min((w.prompt_tokens + w.response_tokens / 2) / w.cache_length, 1.0)
    out = {"prompt_tokens": prompt, "prefill_tokens": prompt + w.rows * w.observation_tokens,
           "decode_steps": steps, "calls": calls, "context": context}
    if w.max_tokens_per_step:
        out["tokens"] = out["prefill_tokens"] + w.rows * generated
        out["steps"] = max(out["tokens"] / w.max_tokens_per_step, steps)
    return out


def _call_s(flops: float, bytes_: float, ici_bytes: float, chip: Any) -> float:
    return max(flops / chip.peak_flops, bytes_ / chip.hbm_bandwidth, ici_bytes / chip.ici_bandwidth)


def step_bound(reports: dict[str, Any], chip: Any, w: Workload) -> list[Part]:
    """The parts of one step's time bound, in the order they run, from the compiled programs'
    `Report`s by name (sync, prefill, decode or step, score, update; a missing one is left out) on `chip`."""
    from workflow_r1.aot.compiled import roofline_s

    n = rollout_counts(w)
    parts = []
    if "sync" in reports:
        s = reports["sync"]
        parts.append(Part("sync", 1, roofline_s(s, chip), f"{s.ici_bytes / 2**30:.2f} GiB received per chip over "
                                                          f"ICI, {s.min_bytes / 2**30:.2f} GiB read + written in HBM"))
    if w.max_tokens_per_step:  # the engine runs ragged steps, none of the calls' programs
        parts += [_ragged_part(reports["step"], chip, w, n)] if "step" in reports else []
    else:
        parts += _call_parts(reports, chip, w, n)
    for name in ("score", "update"):
        if name in reports:
            parts.append(Part(name, 1, roofline_s(reports[name], chip), "the slice's whole batch"))
    return parts


def _call_parts(reports: dict[str, Any], chip: Any, w: Workload, n: dict[str, float]) -> list[Part]:
    """The rollout as the engine's calls: prefill (and view) per call, decode per step."""
    ctx = n["context"]
    parts = []
    if "prefill" in reports:
        p = reports["prefill"]
        per_token = (p.executed_flops - p.attention_flops * (1 - ctx)) / (w.rows_in_flight * w.prefill_chunk)
        weights = p.min_bytes - p.cache_bytes
        calls = n["calls"]
        s = calls * _call_s(per_token * n["prefill_tokens"] / calls, weights + p.cache_bytes * ctx,
                            p.ici_bytes, chip)
        parts.append(Part("prefill", calls, s, f"{n['prefill_tokens']:,.0f} tokens ({n['prompt_tokens']:,} of "
                                                 f"prompts) in {calls:,.0f} calls"))
        if w.view:  # attention over the pages in place has no copy
            parts.append(Part("view", calls, calls * 2 * p.cache_bytes * ctx / chip.hbm_bandwidth,
                              "rows' pages read, working cache written"))
    if "decode" in reports and n["decode_steps"]:
        d = reports["decode"]
        s = _call_s(d.executed_flops - d.attention_flops * (1 - ctx), d.min_bytes - d.cache_bytes * (1 - ctx),
                    d.ici_bytes, chip)
        parts.append(Part("decode", n["decode_steps"], n["decode_steps"] * s,
                          f"{w.rows:,} rows x {w.response_tokens - w.observation_tokens:,.0f} tokens, "
                          f"{w.rows_in_flight} a step"))
    return parts


def _ragged_part(st: Any, chip: Any, w: Workload, n: dict[str, float]) -> Part:
    """The rollout as ragged engine steps, from the compiled full step `st` (`step_tokens` tokens
    attending to at most `cache_length` slots each)."""
    ctx = n["context"]
    per_token = (st.executed_flops - st.attention_flops * (1 - ctx)) / w.step_tokens
    steps = n["steps"]
    tokens = n["tokens"] / steps  # a step's tokens
    rows = min(w.rows_in_flight, tokens)  # the rows whose KV a step reads, at the mean context
    kv = rows * ctx * w.cache_length * w.kv_bytes_per_token
    s = steps * _call_s(per_token * tokens, st.min_bytes + kv, st.ici_bytes, chip)
    decoded = n["tokens"] - n["prefill_tokens"]
    return Part("step", steps, s, f"{n['tokens']:,.0f} tokens ({n['prompt_tokens']:,} of prompts, {decoded:,.0f} "
                                  f"decoded) in steps of <= {w.max_tokens_per_step:,}")


def format_bound(parts: list[Part], w: Workload) -> str:
    """The parts side by side, their sum and the rollout's share, then the assumptions."""
    rollout = sum(p.seconds for p in parts if p.name in ("prefill", "view", "decode", "step"))
    total = sum(p.seconds for p in parts)
    lines = [f"{'part':8} {'calls':>10} {'ms a call':>10} {'s a step':>9}  what"]
    lines += [f"{p.name:8} {p.calls:>10,.0f} {1e3 * p.seconds / p.calls:>10.2f} {p.seconds:>9.1f}  {p.note}"
              for p in parts]
    lines.append(f"step time >= {total:,.1f} s, of which the rollout of every row >= {rollout:,.1f} s")
    shared, per_group, per_row, _ = prompt_tokens_computed(w)
    lines.append(f"assumptions: {w.rows:,} rows per host, {w.rows_in_flight} in flight; prompt {w.prompt_tokens:,} "
                 f"tokens computed as {shared:,} once per host + {per_group:,} per group of {w.group} + {per_row:,} "
                 f"per row (pages of {w.page_size}); response {w.response_tokens:,.0f} tokens per row, "
                 f"{w.observation_tokens:,.0f} of them observations; "
                 + ("every call full; " if not w.max_tokens_per_step else
                    f"ragged steps of <= {w.max_tokens_per_step:,} tokens, every step full or every row in flight "
                    "decoding; ")
                 + "attention and cache reads "
                 f"at the mean context ({w.prompt_tokens + w.response_tokens / 2:,.0f} of {w.cache_length:,} slots); "
                 "executor time, ICI traffic but the sampler's weight gathers and sync, and host work not included.")
    return "\n".join(lines)


# The prompt the paper preset opens with (the faithful prompt set, Qwen2.5's tokenizer, the bundled
# questions): 1,120 to 1,136 tokens, the first 1,116 the same for every question.
PROMPT_TOKENS, TEMPLATE_TOKENS = 1128, 1116
# Observations' share of the response tokens in our local runs (docs/ablation: 360 steps of the
# 0.5B, mean 184 response tokens of which 112 generated); the paper reports no lengths.
OBSERVATION_SHARE = 0.39


def workload(run: Any, info: dict[str, Any], hosts: int, *, response_tokens: float = -1,
             observation_share: float = OBSERVATION_SHARE, prompt_tokens: int = PROMPT_TOKENS,
             template_tokens: int = TEMPLATE_TOKENS) -> Workload:
    """The `Workload` of config `run` (`aot.Sections`) compiled as `info` (`aot.compile_all`) on a
    slice of `hosts` hosts. response_tokens < 0: the whole budget (rollout.max_response_tokens).
    Prompt and response are capped at the config's budgets."""
    r = run.rollout
    rows = r.prompts_per_step * r.n // hosts
    response = min(r.max_response_tokens if response_tokens < 0 else response_tokens, r.max_response_tokens)
    prompt = min(prompt_tokens, r.max_prompt_tokens)
    return Workload(rows=rows, group=r.n,
                    rows_in_flight=info.get("rollout_rows", min(rows, r.max_rows_in_flight or rows)),
                    prompt_tokens=prompt, template_tokens=min(template_tokens, prompt),
                    response_tokens=response, observation_tokens=response * observation_share,
                    page_size=r.page_size, decode_burst=r.decode_burst,
                    prefill_chunk=info.get("prefill_chunk", 512), cache_length=info.get("cache_length", r.cache_size),
                    view=info.get("paged_attention", "view") == "view", max_tokens_per_step=r.max_tokens_per_step,
                    step_tokens=info.get("step_tokens", 0), kv_bytes_per_token=info.get("kv_bytes_per_token", 0))
