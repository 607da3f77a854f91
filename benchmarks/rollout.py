"""Rollout throughput: the multi-turn engine on the real 0.5B policy, where a training step's time goes.

    .venv/bin/python benchmarks/rollout.py [--batches 8,32] [--update_batches 8] [--executor_delay_s 0.5]
    .venv/bin/python benchmarks/rollout.py --executors fake,embedded \
        --latency lognormal --batches 32 --update_batches "" \
        --max_response_tokens 256 --max_turn_tokens 128 --max_assistant_turns 3   # the local preset's budgets

For each batch size B (= B/n questions x n samples, bundled questions): the policy is the bundled
Qwen2.5-Coder-0.5B-Instruct (bf16 rollouts through the fused CPU sampler from fp32 weights, as the
`local` preset), the executor is the real HTTP service in-process with the fake LLM answering after
`--executor_delay_s` seconds (a stand-in for a remote operator LLM; Search over the bundled corpus),
and the system prompt is the `local` preset's prompt set (`--prompt_set`). It runs one rollout
(after a warm-up of the same size on other questions, which compiles; XLA compile seconds left in
the timed run are a column of their own) and reports trajectories/s, generated tokens/s
and the share of the rollout's wall time spent generating and waiting for the executor, and what
the sampler's cache writes cost (its `extend` calls: token positions computed, rows x chunk of each
call, against the tokens written: prompts, observations, pending tokens); for the
sizes in `--update_batches` it also packs the batch and times the GSsPO update (fp32, remat, one
mini-batch), so the three phases of a step can be compared. Peak memory is the process's peak RSS.

The executor's share of the wall time is the time the engine had nothing to compute (every episode
in flight waiting for its tool call).

`--max_rows_in_flight`, `--page_size` and `--kv_cache_pages` set the engine's rows in flight and KV
pages (`rollout.*`); the table reports its KV bytes allocated and held at peak, its prefix-cache hit
rate and preemptions. `--latency lognormal` adds a long-tailed operator latency on top of the
executor's (median `--latency_median_s`, p90 4x the median): each call waits its own draw, seeded
by the call, so runs see the same draws. Each batch's plain batched `generate` of as many rows (64
tokens, no EOS) is measured in the same run: the sampler's own decode rate on this machine, the
peer of the engine's generated tok/s.

`--modes calls,ragged-256` times the engine's two ways of computing in the same run, each on its
own sampler: calls (`rollout.max_tokens_per_step=0`: each call writes its rows' pending tokens,
then decodes a burst) and ragged steps of at most N tokens; a `gather-` prefix runs a mode on the
model path's in-place pages (bf16) instead of the default sampler (the fused CPU path on a CPU).
The table's "engine steps or calls" column counts the policy's calls or steps.

`--executors fake,embedded` times each batch with both executors: `fake` as above, and
`embedded`, the `local` preset's executor section (the bundled model as the operator LLM in this
process, competing with the policy for the same cores; no added latency). The warm-up of a batch
runs once, through the last executor listed, so it also compiles the embedded LLM's programs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from absl import app, flags  # noqa: E402

from workflow_r1.host_memory import peak_rss_gb  # noqa: E402

_BATCHES = flags.DEFINE_list("batches", ["8", "32"], "rollout batch sizes (episodes)")
_UPDATE_BATCHES = flags.DEFINE_list("update_batches", ["8"], "batch sizes whose update is timed too")
_N = flags.DEFINE_integer("n", 4, "samples per question")
_DELAY = flags.DEFINE_float("executor_delay_s", 0.5, "fake operator LLM latency per call, seconds")
_MAX_RESPONSE = flags.DEFINE_integer("max_response_tokens", 512, "response budget per episode")
_MAX_TURN = flags.DEFINE_integer("max_turn_tokens", 160, "cap per assistant turn")
_MAX_TURNS = flags.DEFINE_integer("max_assistant_turns", 4, "assistant turns per episode")
_PRESET = flags.DEFINE_string("model_preset", "", "policy model preset ('' = the bundled 0.5B; 'tiny-chat' "
                              "for a smoke run of the script)")
_CHECKPOINT = flags.DEFINE_string("checkpoint", "", "policy HF checkpoint directory ('' = the bundled 0.5B)")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt_tokens", 1024,
                                   "longest prompt (the byte-level tiny policy needs more)")
_SLOTS = flags.DEFINE_integer("max_rows_in_flight", 0, "the engine's most admitted "
                              "(0 = the batch)")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 64, "tokens per KV page")
_PAGES = flags.DEFINE_integer("kv_cache_pages", 0, "the engine's page budget (0 = every row at its longest)")
_LATENCY = flags.DEFINE_enum("latency", "none", ["none", "lognormal"], "extra operator latency per call")
_EXECUTORS = flags.DEFINE_list("executors", ["fake"], "executors to time per batch: fake (the "
                                "HTTP service with the fake LLM), embedded (the local preset's executor)")
_PROMPT_SET = flags.DEFINE_string("prompt_set", "local", "the environment's prompt set (the local preset's)")
_MODES = flags.DEFINE_list("modes", ["calls"], "how the engine computes, each timed in the same run: calls "
                           "(rollout.max_tokens_per_step=0: calls that write, then decode a burst) or ragged-N "
                           "(ragged steps of at most N tokens), on the default sampler (the fused CPU path on a "
                           "CPU); with a gather- prefix, on the model path's in-place pages in bf16")
_LATENCY_MEDIAN = flags.DEFINE_float("latency_median_s", 1.0, "median of the lognormal latency, seconds")
# sigma of a lognormal whose p90 is 4x its median: ln 4 / z_0.9.
_SIGMA = 1.3862943611198906 / 1.2815515655446004


def _plain_decode(sampler, tokenizer, rows: int, new_tokens: int = 64) -> float:
    """Generated tokens/s of one plain batched `generate` of `rows` copies of a short prompt, each
    decoding `new_tokens` (no EOS), after a warm-up call of the same shape: the sampler's own rate."""
    import time as _time
    prompt = tokenizer.encode("Write a long story about a lighthouse keeper.", add_special_tokens=False)
    kw = dict(temperature=1.0, seed=0, eos_ids=())
    sampler.generate([prompt] * rows, new_tokens, **kw)
    t0 = _time.perf_counter()
    out = sampler.generate([prompt] * rows, new_tokens, **kw)
    return sum(len(t) for t in out.tokens) / (_time.perf_counter() - t0)


def _with_latency(execute, median_s: float):
    """`execute` after a lognormal latency: a batch of concurrent calls waits its largest draw."""
    import math
    import random
    import threading

    lock, draws = threading.Lock(), {}

    def draw(call) -> float:
        with lock:
            n = draws[call] = draws.get(call, -1) + 1  # the k-th identical call gets the k-th draw
        return random.Random(f"{call}|{n}").lognormvariate(math.log(median_s), _SIGMA)

    def run(calls, templates):
        wait = max(draw(c) for c in calls)
        out = execute(calls, templates)
        time.sleep(wait)
        return out

    def reset() -> None:
        with lock:
            draws.clear()

    run.reset = reset
    return run


def _local_executor():
    """The `local` preset's executor section (the bundled model as operator LLM, embedded)."""
    from workflow_r1 import configlib, run_config
    return run_config.Run.from_config(configlib.load(str(REPO / "configs/gsspo.py:local"), [])).executor


_COMPILE_S = [0.0]  # XLA compile seconds so far (a warm-up on other questions can miss a shape)


def _count_compiles() -> None:
    import jax

    def listener(event: str, seconds: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            _COMPILE_S[0] += seconds

    jax.monitoring.register_event_duration_secs_listener(listener)


# The sampler's `extend` calls (writing prompts, observations and pending tokens into the KV cache):
# [calls, token positions computed (rows x chunk of every call), tokens actually written].
_EXTEND = [0, 0, 0]


def _count_extends() -> None:
    from workflow_r1.sampler import loop

    extend = loop.extend

    def counted(impl, weights, cache, logits, tokens, counts, rows=None):
        _EXTEND[0] += 1
        _EXTEND[1] += tokens.shape[0] * tokens.shape[1]
        _EXTEND[2] += int(counts.sum())
        return extend(impl, weights, cache, logits, tokens, counts, rows)

    loop.extend = counted


def _load() -> float:
    return os.getloadavg()[0]


def main(argv: list[str]) -> None:
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    from workflow_r1.data.questions import bundled_questions
    from workflow_r1.task.config import EnvConfig
    from workflow_r1.executor.connect import ExecutorConfig, connect
    from workflow_r1 import policy
    from workflow_r1 import trajectory
    from workflow_r1.rl import advantages, train_state, train_step as ts
    from workflow_r1.envs.workflow import WorkflowEnvironment
    from workflow_r1.rollout import RolloutConfig, RolloutEngine, episode_metrics, pack, padded_length
    from workflow_r1.sampler import Sampler

    print(f"jax {jax.__version__}, {os.cpu_count()} cores, load {_load():.2f}", flush=True)
    _count_compiles()
    _count_extends()
    # Off the CPU the sampler runs the model's own forward in the model's dtype: bf16 there, unless
    # an update is timed (fp32 weights).
    on_cpu = jax.default_backend() == "cpu"
    dtype = "float32" if on_cpu or any(_UPDATE_BATCHES.value) else "bfloat16"
    model, tokenizer = policy.load(policy.ModelConfig(preset=_PRESET.value, checkpoint=_CHECKPOINT.value,
                                                      dtype=dtype, param_dtype=dtype, remat=True))
    state = step = None
    if any(_UPDATE_BATCHES.value):  # fp32 weights, AdamW moments: only when an update is timed
        tcfg = train_state.TrainConfig(num_mini_batches=1, micro_batch_size=None)
        state, step = train_state.create_train_state(model, tcfg), ts.make_train_step(tcfg)
        model = state.model()
    rcfg = RolloutConfig(n=_N.value, max_prompt_tokens=_MAX_PROMPT.value,
                         max_response_tokens=_MAX_RESPONSE.value, max_turn_tokens=_MAX_TURN.value,
                         max_assistant_turns=_MAX_TURNS.value, sampler_dtype="bfloat16", pad_multiple=256)
    sampler = Sampler(model, tokenizer, cache_size=rcfg.cache_size, dtype=jnp.bfloat16 if on_cpu else None)
    modes, bf16 = {}, None
    for mode in _MODES.value:
        kind = mode.removeprefix("gather-")
        if kind != "calls" and not (kind.startswith("ragged-") and kind[7:].isdigit()):
            raise app.UsageError(f"--modes: {mode!r} unknown; use calls or ragged-N, optionally gather-prefixed")
        budget = 0 if kind == "calls" else int(kind[7:])
        if mode == kind:
            modes[mode] = (Sampler(model, tokenizer, cache_size=rcfg.cache_size, dtype=jnp.bfloat16 if on_cpu else None,
                                   ragged=budget > 0), budget)
            continue
        if bf16 is None:  # the model path computes in the model's dtype: a bf16 copy, as `local` runs
            bf16 = policy.load(policy.ModelConfig(preset=_PRESET.value, checkpoint=_CHECKPOINT.value,
                                                  dtype="bfloat16", param_dtype="bfloat16"))[0]
        modes[mode] = (Sampler(bf16, tokenizer, cache_size=rcfg.cache_size, impl="model", paged_attention="gather"),
                       budget)
    questions = bundled_questions()
    rows = []
    unknown = set(_EXECUTORS.value) - {"fake", "embedded"}
    if unknown:
        raise app.UsageError(f"--executors: {sorted(unknown)} unknown; use fake and/or embedded")
    with contextlib.ExitStack() as stack:
        executes = {}
        for kind in _EXECUTORS.value:
            if kind == "fake":
                ex = stack.enter_context(connect(ExecutorConfig(llm="fake", search="bm25")))
                ex.server.service.runner.llm.delay_s = _DELAY.value
                execute = ex.client.execute_many_sync
                if _LATENCY.value == "lognormal":
                    execute = _with_latency(execute, _LATENCY_MEDIAN.value)
            else:
                execute = stack.enter_context(connect(_local_executor())).client.execute_many_sync
            executes[kind] = execute
        plain = {int(x): _plain_decode(sampler, tokenizer, int(x)) for x in _BATCHES.value}
        for b, (mode, (sampler, budget)) in ((int(x), m) for x in _BATCHES.value for m in modes.items()):
            cfg = dataclasses.replace(rcfg, max_rows_in_flight=_SLOTS.value, page_size=_PAGE_SIZE.value,
                                      kv_cache_pages=_PAGES.value, max_tokens_per_step=budget)
            qs = questions[:b // rcfg.n]
            # Warm-up on other questions of the same batch size: compiles the prefill / decode
            # programs of this row count, so the timed run measures generation, not compilation.
            env = EnvConfig(prompt_set=_PROMPT_SET.value)
            RolloutEngine(sampler, cfg, WorkflowEnvironment.of(tokenizer, executes[_EXECUTORS.value[-1]], env, cfg)).run(
                questions[-(b // rcfg.n):], n=rcfg.n, seed=99)
            for kind, execute in executes.items():
                getattr(execute, "reset", lambda: None)()
                engine = RolloutEngine(sampler, cfg, WorkflowEnvironment.of(tokenizer, execute, env, cfg))
                load0, compile0, extend0 = _load(), _COMPILE_S[0], list(_EXTEND)
                episodes, stats = engine.run(qs, n=rcfg.n, seed=b)
                # (the embedded executor's LLM runs the same sampler code: its writes count too)
                calls, computed, written = (x - y for x, y in zip(_EXTEND, extend0))
                m = episode_metrics(episodes)
                row = {"batch": b, "mode": mode, "rounds": stats.rounds, "executor": kind, "kv_mb": stats.kv_cache_bytes / 2**20,
                       "kv_peak_mb": stats.kv_bytes_peak / 2**20, "kv_overhead": stats.kv_overhead,
                       "prefix_hit": stats.prefix_hit_rate,
                       "preemptions": stats.preemptions, "plain_decode_tok_per_s": plain.get(b, 0.0),
                       "prefill_per_episode": stats.prefill_tokens / len(episodes),
                       "extend_calls": calls, "extend_computed": computed / len(episodes),
                       "extend_written": written / len(episodes),
                       "seconds": stats.seconds_total, "compile_s": _COMPILE_S[0] - compile0,
                       "traj_per_s": len(episodes) / stats.seconds_total,
                       "gen_tok_per_s": stats.generated_tokens / stats.seconds_generate,
                       "gen_tok_per_wall_s": stats.generated_tokens / stats.seconds_total,
                       "gen_share": stats.seconds_generate / stats.seconds_total,
                       "exec_share": stats.seconds_executor / stats.seconds_total, "turns": m["turns"],
                       "calls": m["calls"],
                       "executor_calls": sum(t.action == "tool" for e in episodes for t in e.turns) / len(episodes),
                       "gen_tokens": m["generated_tokens"], "load": max(load0, _load())}
                if str(b) in _UPDATE_BATCHES.value and kind == _EXECUTORS.value[0] and mode == _MODES.value[0]:
                    rewards = np.array([e.reward for e in episodes], np.float32)
                    adv = np.asarray(advantages.grpo_advantages(jnp.asarray(rewards), group_size=rcfg.n))
                    batch = trajectory.shard_batch(pack(episodes, adv, pad_id=tokenizer.pad_token_id,
                                                       length=padded_length(episodes, rcfg.pad_multiple)), None)
                    sampler.release_params()
                    state, _ = step(state, batch)  # compile
                    jax.block_until_ready(state.params)
                    t0 = time.perf_counter()
                    state, _ = step(state, batch)
                    jax.block_until_ready(state.params)
                    sampler.update_params(state.params)
                    row["update_s"] = time.perf_counter() - t0
                    row["batch_length"] = batch.tokens.shape[1]
                row["peak_rss_gb"] = peak_rss_gb()
                rows.append(row)
                print(row, flush=True)
    print("\n| batch | mode | executor | engine steps or calls | plain batched decode (tok/s) | KV held, peak (MB) "
          "| KV slots per token held | prefix hit rate | preemptions |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['mode']} | {r['executor']} | {r['rounds']} | {r['plain_decode_tok_per_s']:.1f} | "
              f"{r['kv_peak_mb']:.0f} | {r['kv_overhead']:.2f} | {r['prefix_hit']:.0%} | {r['preemptions']} |")
    print("\n| batch | mode | executor | KV cache (MB) | prefill tok/episode | trajectories/s | generated tok/s "
          "(per wall s) | XLA compile (s) | cache writes: calls, positions computed / written per episode | generation | executor wait | turns | calls (to the executor) | update (s) "
          "| step: gen / exec / update | peak RSS (GB) | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        upd = r.get("update_s")
        if upd:
            tot = r["seconds"] + upd
            split = (f"{r['gen_share'] * r['seconds'] / tot:.0%} / {r['exec_share'] * r['seconds'] / tot:.0%} / "
                     f"{upd / tot:.0%}")
        else:
            split = "-"
        print(f"| {r['batch']} | {r['mode']} | {r['executor']} | {r['kv_mb']:.0f} | "
              f"{r['prefill_per_episode']:.0f} | {r['traj_per_s']:.3f} | "
              f"{r['gen_tok_per_s']:.1f} ({r['gen_tok_per_wall_s']:.1f}) | {r['compile_s']:.0f} | "
              f"{r['extend_calls']}, {r['extend_computed']:.0f} / {r['extend_written']:.0f}"
              f"{' (incl. the executor LLM)' if r['executor'] == 'embedded' else ''} | "
              f"{r['gen_share']:.0%} | {r['exec_share']:.0%} | {r['turns']:.2f} | "
              f"{r['calls']:.2f} ({r['executor_calls']:.2f}) | "
              f"{upd and f'{upd:.1f}' or '-'} | {split} | {r['peak_rss_gb']:.1f} | {r['load']:.2f} |")


if __name__ == "__main__":
    app.run(main)
