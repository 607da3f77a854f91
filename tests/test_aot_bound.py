"""workflow_r1.aot.bound: the whole-step bound's accounting on made-up per-program costs (no
compilation): prefix caching against a page-cache simulation, every row counted, no decode without
a response, each part priced as max(flops / peak, bytes / bandwidth) per call."""
from __future__ import annotations

import dataclasses

import pytest

from workflow_r1 import aot
from workflow_r1.aot import bound

CHIP = aot.CHIPS["v5p"]


def _workload(**kw) -> bound.Workload:
    base = dict(rows=256, group=8, rows_in_flight=32, prompt_tokens=1128, template_tokens=1116,
                response_tokens=4000, observation_tokens=1000, page_size=64, decode_burst=128, prefill_chunk=512,
                cache_length=9536)
    return bound.Workload(**{**base, **kw})


def _reports() -> dict[str, aot.Report]:
    """Per device per call: a decode step that is memory-bound, a prefill call compute-bound."""
    gib = 2**30
    r = lambda name, **kw: aot.Report(name, 0, 0, 0, 0, 0, 0, 0, 0, "", **kw)  # noqa: E731
    return {"prefill": r("prefill", executed_flops=4e14, attention_flops=1e14, min_bytes=30 * gib, cache_bytes=4 * gib),
            "decode": r("decode", executed_flops=1e12, attention_flops=2e11, min_bytes=30 * gib, cache_bytes=4 * gib),
            "score": r("score", executed_flops=459e12 * 7, min_bytes=1e9),
            "update": r("update", executed_flops=459e12 * 100, min_bytes=1e9)}


def _simulated_prompt_tokens(rows: int, group: int, prompt: int, template: int, page: int) -> int:
    """Tokens a prefix cache of whole pages computes for `rows` prompts, a group of `group` rows per
    question, all opening with the same `template` tokens: each row reuses its longest run of
    cached leading pages, never the page of its last token, and caches its full pages."""
    cached: set[tuple[int, ...]] = set()
    computed = 0
    for i in range(rows):
        q = i // group
        tokens = list(range(template)) + [10_000 * (q + 1) + j for j in range(prompt - template)]
        hit = 0
        while (hit + 1) * page <= prompt - 1 and tuple(tokens[:(hit + 1) * page]) in cached:
            hit += 1
        computed += prompt - hit * page
        cached.update(tuple(tokens[:k * page]) for k in range(1, prompt // page + 1))
    return computed


@pytest.mark.parametrize("rows, group, prompt, template, page", [
    (24, 4, 150, 100, 16),   # template ends inside a page
    (24, 4, 160, 96, 16),    # prompt a whole number of pages: its last page is recomputed per row
    (10, 4, 150, 100, 16),   # a last group of 2
    (8, 8, 1128, 1116, 64),  # the paper's prompt
    (6, 3, 40, 0, 16),       # nothing shared across groups
])
def test_prompt_tokens_match_a_page_cache(rows, group, prompt, template, page):
    w = _workload(rows=rows, group=group, prompt_tokens=prompt, template_tokens=template, page_size=page)
    assert bound.prompt_tokens_computed(w)[3] == _simulated_prompt_tokens(rows, group, prompt, template, page)


def _rollout_s(parts: list[bound.Part]) -> dict[str, float]:
    return {p.name: p.seconds for p in parts if p.name in ("prefill", "view", "decode")}


def test_twice_the_rows_is_twice_the_rollout():
    one, two = _workload(rows=256, template_tokens=0), _workload(rows=512, template_tokens=0)
    a, b = (_rollout_s(bound.step_bound(_reports(), CHIP, w)) for w in (one, two))
    assert set(a) == {"prefill", "view", "decode"}
    for k in a:
        assert b[k] == pytest.approx(2 * a[k])
    # With a shared template, only its pages are not counted twice.
    one, two = _workload(rows=256), _workload(rows=512)
    shared = bound.prompt_tokens_computed(one)[0]
    assert shared == 1088
    assert bound.prompt_tokens_computed(two)[3] == 2 * bound.prompt_tokens_computed(one)[3] - shared
    # The update and scoring run once on the slice's batch, whatever a host's rows.
    s1, s2 = ({p.name: p.seconds for p in bound.step_bound(_reports(), CHIP, w)} for w in (one, two))
    assert s1["update"] == s2["update"] == pytest.approx(100) and s1["score"] == pytest.approx(7)


def test_each_part_is_its_calls_at_the_roofline():
    w = _workload()
    gib = 2**30
    # The compiled sync: 6 GB its collectives deliver a chip, 10 GiB of fp32 shards read and bf16 written.
    sync = aot.Report("sync", 0, 0, 0, 0, 0, 0, 0, 0, "", ici_bytes=6e9, min_bytes=10 * gib)
    parts = {p.name: p for p in bound.step_bound({**_reports(), "sync": sync}, CHIP, w)}
    assert list(parts) == ["sync", "prefill", "view", "decode", "score", "update"]
    ctx = (1128 + 4000 / 2) / 9536
    steps = 256 * 3000 / 32  # every row's generated tokens, 32 rows a step
    decode = max((1e12 - 2e11 * (1 - ctx)) / CHIP.peak_flops, (26 * gib + 4 * gib * ctx) / CHIP.hbm_bandwidth)
    assert decode == (26 * gib + 4 * gib * ctx) / CHIP.hbm_bandwidth  # memory-bound, as made up
    assert parts["decode"].calls == steps and parts["decode"].seconds == pytest.approx(steps * decode)
    calls = steps / 128  # bursts of 128 tokens: more than one call per row
    assert parts["prefill"].calls == calls == parts["view"].calls
    tokens = 1088 + 256 * 40 + 256 * 1000  # template once, no group pages past it, 40 per row, observations
    per_token = (4e14 - 1e14 * (1 - ctx)) / (32 * 512)
    prefill = max(per_token * tokens / calls / CHIP.peak_flops, (26 * gib + 4 * gib * ctx) / CHIP.hbm_bandwidth)
    assert parts["prefill"].seconds == pytest.approx(calls * prefill)
    assert parts["view"].seconds == pytest.approx(calls * 2 * 4 * gib * ctx / CHIP.hbm_bandwidth)
    # Attention over the pages in place (the TPU kernel) copies nothing: the same parts, less the view.
    in_place = {p.name: p for p in bound.step_bound({**_reports(), "sync": sync}, CHIP,
                                                   dataclasses.replace(w, view=False))}
    assert list(in_place) == ["sync", "prefill", "decode", "score", "update"]
    assert all(in_place[k].seconds == parts[k].seconds for k in in_place)
    # A prefill of few flops is its weights and its rows' mean context read once per call.
    cheap = {"prefill": dataclasses.replace(_reports()["prefill"], executed_flops=1e9, attention_flops=0)}
    (p, _) = bound.step_bound(cheap, CHIP, w)
    assert p.seconds == pytest.approx(calls * (26 * gib + 4 * gib * ctx) / CHIP.hbm_bandwidth)
    assert parts["sync"].calls == 1 and parts["sync"].seconds == pytest.approx(6e9 / 600e9)  # ICI-bound
    # A sync that moves little (its layout already the sampler's: a cast) is its HBM reads and writes.
    cast = dataclasses.replace(sync, ici_bytes=0)
    (s, _) = bound.step_bound({"sync": cast, "update": _reports()["update"]}, CHIP, w)
    assert s.name == "sync" and s.seconds == pytest.approx(10 * gib / CHIP.hbm_bandwidth)
    # A sampler on an FSDP mesh gathers the weight shards it lacks at every call, over the ICI.
    gathered = {k: dataclasses.replace(r, ici_bytes=20 * gib) for k, r in _reports().items()}
    parts = {p.name: p for p in bound.step_bound(gathered, CHIP, w)}
    assert parts["decode"].seconds == pytest.approx(steps * 20 * gib / CHIP.ici_bandwidth)
    assert parts["prefill"].seconds == pytest.approx(calls * max(prefill, 20 * gib / CHIP.ici_bandwidth))


def test_no_response_no_decode_and_one_call_per_wave():
    w = _workload(response_tokens=0, observation_tokens=0)
    parts = {p.name: p for p in bound.step_bound(_reports(), CHIP, w)}
    assert "decode" not in parts and parts["prefill"].calls == 256 // 32
    assert "sync" not in parts  # the sampler reads the train state's own weights


def test_short_responses_still_need_a_call_per_row():
    w = _workload(rows=100, response_tokens=20, observation_tokens=0)
    assert bound.rollout_counts(w)["calls"] == 4  # 100 rows, 32 a call


def test_workload_from_a_config_counts_a_hosts_rows_and_caps_at_the_budgets():
    from configs import gsspo

    run = aot.Sections.from_config(gsspo.get_config("paper"))
    w = bound.workload(run, {"rollout_rows": 32, "cache_length": 9536}, hosts=2)
    assert (w.rows, w.group, w.rows_in_flight) == (2048, 8, 32)
    assert w.response_tokens == 8192 and w.observation_tokens == pytest.approx(8192 * bound.OBSERVATION_SHARE)
    w = bound.workload(run, {}, hosts=1, response_tokens=50_000, prompt_tokens=2000)
    assert (w.rows, w.response_tokens, w.prompt_tokens, w.rows_in_flight) == (4096, 8192, 1280, 256)  # the preset's


def test_ragged_steps_are_every_token_once_at_the_roofline():
    """rollout.max_tokens_per_step = N: the rollout is the compiled step's calls, not prefill, view and
    decode: every prompt, observation and decoded token once, at most N a step and one decoded token
    per row in flight a step; each step reads the weights and its rows' KV at the mean context."""
    gib = 2**30
    step = aot.Report("step", 0, 0, 0, 0, 0, 0, 0, 0, "", executed_flops=4e14, attention_flops=1e14,
                      min_bytes=30 * gib)
    kvt = 14_074  # a token's K and V per device
    reports = {**_reports(), "step": step}
    w = _workload(max_tokens_per_step=4096, step_tokens=4096, kv_bytes_per_token=kvt)
    parts = {p.name: p for p in bound.step_bound(reports, CHIP, w)}
    assert list(parts) == ["step", "score", "update"]  # the calls' programs are not what runs
    prompt = 1088 + 256 * 40  # the template once, 40 per row
    tokens = prompt + 256 * 1000 + 256 * 3000  # prompts, observations, decoded
    decode_steps = 256 * 3000 / 32
    assert tokens / 4096 < decode_steps  # a decoded token per row a step bounds this rollout
    assert parts["step"].calls == pytest.approx(decode_steps)
    ctx = (1128 + 4000 / 2) / 9536
    per_step = tokens / decode_steps  # 43 tokens a step, of at most 32 rows: 32 rows' KV read
    kv = 32 * ctx * 9536 * kvt
    flops = (4e14 - 1e14 * (1 - ctx)) / 4096 * per_step
    one = max(flops / CHIP.peak_flops, (30 * gib + kv) / CHIP.hbm_bandwidth)
    assert one == (30 * gib + kv) / CHIP.hbm_bandwidth  # memory-bound: the weights each step
    assert parts["step"].seconds == pytest.approx(decode_steps * one)
    # 4x the rows in flight and a budget of 128 tokens: the budget binds, and a step reads 128 rows' KV.
    w4 = dataclasses.replace(w, rows_in_flight=128, max_tokens_per_step=128)
    p4 = {p.name: p for p in bound.step_bound(reports, CHIP, w4)}["step"]
    assert p4.calls == pytest.approx(tokens / 128) and tokens / 128 > 256 * 3000 / 128
    kv4 = 128 * ctx * 9536 * kvt
    flops4 = (4e14 - 1e14 * (1 - ctx)) / 4096 * 128
    assert p4.seconds == pytest.approx(tokens / 128 * max(flops4 / CHIP.peak_flops,
                                                          (30 * gib + kv4) / CHIP.hbm_bandwidth))
    # A budget of 64 tokens under 128 rows in flight: a step holds at most 64 rows' tokens, so it
    # reads at most 64 rows' KV, not 128.
    w64 = dataclasses.replace(w, rows_in_flight=128, max_tokens_per_step=64)
    p64 = {p.name: p for p in bound.step_bound(reports, CHIP, w64)}["step"]
    assert p64.calls == pytest.approx(tokens / 64)
    kv64 = 64 * ctx * 9536 * kvt
    flops64 = (4e14 - 1e14 * (1 - ctx)) / 4096 * 64
    assert p64.seconds == pytest.approx(tokens / 64 * max(flops64 / CHIP.peak_flops,
                                                          (30 * gib + kv64) / CHIP.hbm_bandwidth))
    # Without the compiled step there is no rollout part (the calls' programs do not price it).
    assert [p.name for p in bound.step_bound(_reports(), CHIP, w)] == ["score", "update"]
    assert "ragged steps of <= 4,096 tokens" in bound.format_bound(list(parts.values()), w)
