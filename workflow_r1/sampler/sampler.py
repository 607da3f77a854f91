"""The public sampler: batched KV-cache generation for the NNX Qwen2, over several turns.

Used by the rollout engine, the embedded executor backend (executor/local_backend.py) and evaluation.

A batch of rows is a `Session`. Row b holds its first `cached[b]` tokens in its cache slots
(slot = RoPE position, see loop.py). Tokens of a row that are known but not yet written (a new
prompt, an appended observation, the last generated token) are "pending"; `generate_from` first
feeds all pending tokens (right-padded chunks written at each row's own `cache.end[b]`), then
decodes. Continuing a row after `append` therefore costs only the new tokens.

The rollout engine (rollout/paged.py) keeps its sequences' K/V in pages: `new_pages` allocates
them and `generate_paged` runs one call over some sequences (sampler/paged.py: a session on a dense
view of their pages, `generate_from(stop_after=1)` returning at the first finished row, the pages
written copied back), with per-row keys (`seed`, `row_ids`, `step_offset`) so that a sequence's
draws do not depend on its place in a call.

Compiled programs are few: chunk lengths, cache lengths and the output buffer are bucketed (powers
of two), params are a jit argument (the trainer passes new weights without recompiling), and the
decode state (KV cache included) is donated so the cache is updated in place. A session's cache on
the devices (placement over the mesh, allocation, growth, resets, the chunked writes of pending
tokens) is device_cache.py's.

Sampling rules and returned log-probs: see sampling.py (log_softmax(logits / temperature) over the
full vocabulary, not renormalised by top-k / top-p).

Stops, checked per row inside the loop (finished rows stop writing while the others continue):
EOS ids, `max_new_tokens`, the cache limit (`cache_size` tokens per row, prompt included), and stop
strings (stop_strings.py), caught at the exact token that completes them. Generation ends with that
token (it is kept, with its log-prob); nothing after it is generated, so nothing needs trimming.
Text returned by `text.generate_text` is cut exactly after the stop string. Only generated text is
matched (not the prompt).

Shapes: B rows of a session (padded to Bp on device), V vocabulary; token ids are int lists on
the host.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from workflow_r1.model import lora, qwen2
from workflow_r1.sampler import device_cache, fused_cpu, loop, paged, ragged, weights
from workflow_r1.sampler.loop import FINISH_REASONS
from workflow_r1.sampler.session import (PAUSED, SampleOutput, SamplerError, Session, _bucket, _pow2_at_least,
                                         generate_args)
from workflow_r1.sampler.stop_strings import stop_tables, vocab_bytes


# ---------------------------------------------------------------------------------------- sampler

class Sampler:
    """Generates from an NNX Qwen2 with a per-row KV cache. See the module docstring for semantics.

    Args:
      model: the model (its params are split out and passed to the jitted programs as arguments;
        LoRA adapters are merged into the kernels first).
      tokenizer: an HF tokenizer; needed for stop strings and the text helpers.
      cache_size: most tokens a row may hold (prompt + generated + appended).
      buckets: allowed chunk lengths for writing prompts/observations (default: powers of two, at
        least 16, at most `prefill_chunk`); longer inputs are written in several chunks.
      cache_buckets: allowed physical cache lengths (default: powers of two >= 128).
      prefill_chunk: longest chunk written in one call (bounds prefill memory).
      mesh: run on this mesh (batch over data/fsdp, weights on its layout by the logical-axis
        table: the training mesh's own, or a host's tensor-parallel `sharding.tensor_mesh`). In a
        multi-host run it holds this host's devices only: each host generates its own rows at its
        own pace, and `update_params` copies the globally sharded training weights onto it.
      token_bytes: bytes per token id, overriding what `tokenizer` gives (tests, custom vocabularies).
      eos_ids: default EOS ids (default: the model config's, e.g. <|im_end|>, <|endoftext|>).
      impl: "model" runs the NNX model's own forward; "fused_cpu" runs the sampler's CPU path (same
        math, projections stored [out, in], fp32 accumulation; see fused_cpu.py); "auto" picks
        "fused_cpu" on a single CPU device (unless `paged_attention` reads the pages in place) and
        "model" otherwise.
      dtype: compute dtype of the "fused_cpu" path (default: the model's compute dtype), e.g. bfloat16
        rollouts from fp32 training weights; its KV cache is fp32 holding values of this dtype.
        The "model" path always uses the model's.
      weights_dtype: the dtype the sampler holds its copy of the weights in (None: the parameters'
        own), e.g. bfloat16 weights of a bf16-compute model trained on fp32 master weights: the
        same numbers its forward computes with, half the bytes (weights.py). The "fused_cpu" path
        holds its weights in its compute dtype: None or `dtype` only.
      paged_attention: how a rollout engine call reads its rows' KV pages (`generate_paged`):
        "view" copies them into a dense working cache first; "gather" (model path) and "kernel"
        (model path on TPU: jax's ragged paged attention) attend over the pages in place; "auto"
        is "kernel" on TPU, "view" elsewhere (paged.attention_mode).
      ragged: the rollout runs ragged steps (`step_paged`, rollout.max_tokens_per_step): then "auto"
        on the model path off TPU is "gather" (the fused CPU path reads its own pages in place).
    """

    def __init__(self, model: qwen2.Qwen2, tokenizer: Any = None, *, cache_size: int = 4096,
                 buckets: Sequence[int] | None = None, cache_buckets: Sequence[int] | None = None,
                 prefill_chunk: int = 512, mesh: jax.sharding.Mesh | None = None,
                 token_bytes: Sequence[bytes] | None = None, eos_ids: Sequence[int] | None = None,
                 impl: str = "auto", dtype: Any = None, weights_dtype: Any = None, paged_attention: str = "view",
                 ragged: bool = False):
        if cache_size < 2:
            raise SamplerError(f"cache_size={cache_size} must be at least 2")
        if impl not in ("auto", "model", "fused_cpu"):
            raise SamplerError(f"impl={impl!r} unknown; use 'auto', 'model' or 'fused_cpu'")
        if impl == "auto":  # pages read in place ("gather", "kernel") are the model path's
            impl = ("fused_cpu" if mesh is None and jax.default_backend() == "cpu"
                    and paged_attention in ("auto", "view") else "model")
        if ragged and paged_attention == "auto" and impl == "model" and jax.default_backend() != "tpu":
            paged_attention = "gather"  # ragged steps on the model path read the pages in place
        if impl == "fused_cpu" and mesh is not None:
            raise SamplerError("impl='fused_cpu' is the single-device CPU path; use impl='model' with a mesh")
        dtype = jnp.dtype(model.dtype if dtype is None else dtype)
        if impl == "model" and dtype != jnp.dtype(model.dtype):
            raise SamplerError(f"dtype={dtype} differs from the model's compute dtype {jnp.dtype(model.dtype)}; "
                               "impl='model' runs the model as loaded "
                               "(load it with that dtype, or use impl='fused_cpu')")
        if impl == "fused_cpu" and weights_dtype not in (None, "") and jnp.dtype(weights_dtype) != dtype:
            raise SamplerError(f"rollout.weights_dtype={jnp.dtype(weights_dtype)} differs from the fused CPU path's "
                               f"compute dtype {dtype}, which holds its weights; set it to '' or {dtype}")
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        self.cache_size = int(cache_size)
        self.prefill_chunk = int(prefill_chunk)
        self.buckets = sorted(buckets) if buckets else None
        self.cache_buckets = sorted(cache_buckets) if cache_buckets else None
        self.mesh = mesh
        # LoRA adapters are folded into the kernels (lora.merge): decoding runs the base's programs.
        graphdef, params = nnx.split(lora.merge(model))
        # The model path of a model with scanned layers reads a stacked cache; the fused CPU path
        # slices the layers into its own weights and keeps its per-layer cache.
        self._stacked = impl == "model" and bool(getattr(model, "scan_layers", False))
        self._impl = loop.Impl(impl, graphdef if impl == "model" else None, self.cfg, dtype)
        self.cache_dtype = dtype
        self._graphdef = graphdef
        self._sync = weights.Sync(weights_dtype, mesh)
        self._min_rows = fused_cpu.min_rows(dtype) if impl == "fused_cpu" else 1
        self.paged_attention = paged.attention_mode(paged_attention, impl)
        self.update_params(params)
        self._token_bytes = list(token_bytes) if token_bytes is not None else None
        self._tables: dict[tuple[str, ...], jax.Array] = {}
        self.eos_ids = tuple(self.cfg.eos_token_ids if eos_ids is None else eos_ids)
        self._check_ids(self.eos_ids, "eos id")

    # ------------------------------------------------------------------ params / helpers

    def update_params(self, params: Any) -> None:
        """Use new weights (an nnx.State from `nnx.split(model)[1]`, or a model) without recompiling.

        A model with LoRA adapters is merged first (W + scale · A B). On the model path the merge,
        the cast to `weights_dtype` and the move to the sampler's mesh are one compiled program
        (weights.Sync; `sync_seconds` is its last wall time), skipped when the weights already are
        what the sampler reads (then it reads the training arrays themselves).
        """
        self._weights = self.synced(params)

    def synced(self, params: Any) -> Any:
        """The weights `update_params(params)` puts in place, computed but not put in place (for
        `use_weights`). On several hosts this is the gather of the other hosts' shards, a
        collective: asynchronous training runs it where every host runs its collectives in one
        order (the trainer's thread) and the rollout thread only installs the result."""
        if self._impl.kind == "fused_cpu":
            t0 = time.perf_counter()
            if isinstance(params, nnx.Module):
                out = fused_cpu.merged_weights(*nnx.split(params), self.cfg, self._impl.dtype)
            else:
                out = fused_cpu.weights(params, self.cfg, self._impl.dtype)
            out = jax.block_until_ready(out)
            self._sync.seconds = time.perf_counter() - t0
            return out
        return self._sync(params, self._graphdef)

    def use_weights(self, weights: Any) -> None:
        """Puts weights made by `synced` in place (no computation)."""
        self._weights = weights

    @property
    def sync_seconds(self) -> float:
        """Wall seconds of the last `update_params`' weight sync (the fused path's re-layout; 0.0 when
        the model path needed none)."""
        return self._sync.seconds

    def release_params(self) -> None:
        """Drops the sampler's weights (the fused path's re-laid-out copy) until `update_params`.

        A trainer calls this before an update, which needs the memory most and changes the weights
        anyway; generating in between is an error that says so.
        """
        self._weights = None

    @property
    def impl(self) -> str:
        """The forward in use: "model" or "fused_cpu"."""
        return self._impl.kind

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def token_bytes(self) -> list[bytes]:
        if self._token_bytes is None:
            if self.tokenizer is None:
                raise SamplerError("stop strings need token texts: pass tokenizer= (or token_bytes=) to Sampler")
            self._token_bytes = vocab_bytes(self.tokenizer, self.vocab_size)
        return self._token_bytes

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        for t in ids:
            if not 0 <= int(t) < self.vocab_size:
                raise SamplerError(f"{what} {t} is outside the vocabulary [0, {self.vocab_size}); "
                                   "check the tokenizer matches the checkpoint")

    def _stop_table(self, stop_strings: tuple[str, ...]) -> jax.Array:
        if stop_strings not in self._tables:
            for s in stop_strings:
                if not isinstance(s, str) or not s:
                    raise SamplerError(f"stop string {s!r} must be a non-empty str")
            table = stop_tables(stop_strings, self.token_bytes())
            # Padded (never-matching all-zero rows, unused states) to a few shapes: fewer compiles.
            n, width = _pow2_at_least(table.shape[0], 1), -(-table.shape[1] // 16) * 16
            table = np.pad(table, ((0, n - table.shape[0]), (0, width - table.shape[1]), (0, 0)))
            self._tables[stop_strings] = device_cache.replicated(self.mesh, jnp.asarray(table))
        return self._tables[stop_strings]

    # ------------------------------------------------------------------ session API

    def start(self, prompts: Sequence[Sequence[int]], row_offset: int = 0) -> Session:
        """A session over `prompts` (token ids, any lengths); nothing is computed until `generate_from`.

        row_offset: the global index of the first row (see `Session.row_offset`).
        """
        if isinstance(prompts, (str, bytes)) or not len(prompts):
            raise SamplerError("prompts is empty; pass a non-empty list of token-id lists")
        seqs = []
        for i, p in enumerate(prompts):
            seqs.append(self._check_prompt(p, i))
        if row_offset < 0:
            raise SamplerError(f"row_offset={row_offset} must be >= 0")
        return Session(sequences=seqs, cached=np.zeros(len(seqs), np.int64), row_offset=int(row_offset))

    def new_pages(self, num_pages: int, page_size: int) -> paged.KVPages:
        """`num_pages` empty KV pages of `page_size` tokens in this sampler's cache layout (paged.py)."""
        return paged.new_pages(self, num_pages, page_size)

    def generate_paged(self, pages: paged.KVPages, tables: list[list[int]], sequences: list[list[int]],
                       cached: list[int], max_new_tokens: list[int], **sampling: Any
                       ) -> tuple[SampleOutput, paged.KVPages, list[int]]:
        """One call over sequences held in `pages` (see `paged.generate`): (generation, pages, cached)."""
        if self._weights is None:
            raise SamplerError("the sampler has no weights (release_params was called); call update_params first")
        return paged.generate(self, pages, tables, sequences, cached, max_new_tokens, **sampling)

    def step_paged(self, pages: paged.KVPages, tables: list[list[int]], sequences: list[list[int]],
                   cached: list[int], counts: list[int], **sampling: Any
                   ) -> tuple[SampleOutput, paged.KVPages, list[int]]:
        """One ragged step over sequences held in `pages` (see `ragged.step`): each writes its next
        counts[r] tokens, and one whose pending tokens end there samples one: (generation, pages, cached)."""
        if self._weights is None:
            raise SamplerError("the sampler has no weights (release_params was called); call update_params first")
        return ragged.step(self, pages, tables, sequences, cached, counts, **sampling)

    def append(self, session: Session, rows: Sequence[int], tokens: Sequence[Sequence[int]]) -> None:
        """Appends tokens (e.g. an observation) to the given rows; written lazily by the next generate_from."""
        if len(rows) != len(tokens):
            raise SamplerError(f"append got {len(rows)} rows but {len(tokens)} token lists")
        for r, toks in zip(rows, tokens):
            self._check_row(session, r)
            toks = [int(t) for t in toks]
            self._check_ids(toks, f"token id appended to row {r}:")
            if len(session.sequences[r]) + len(toks) > self.cache_size:
                raise SamplerError(f"row {r} has {len(session.sequences[r])} tokens; appending {len(toks)} exceeds "
                                   f"cache_size={self.cache_size}; raise Sampler(cache_size=...) or truncate")
            session.sequences[r].extend(toks)

    def _check_prompt(self, prompt: Sequence[int], i: int) -> list[int]:
        p = [int(t) for t in prompt]
        if not p:
            raise SamplerError(f"prompt {i} is empty; every row needs at least one token")
        if len(p) >= self.cache_size:
            raise SamplerError(f"prompt {i} has {len(p)} tokens but cache_size={self.cache_size} leaves no "
                               "room to generate; raise Sampler(cache_size=...) or shorten the prompt")
        self._check_ids(p, f"token id in prompt {i}:")
        return p

    def _check_row(self, session: Session, r: int) -> None:
        if not 0 <= r < session.num_rows:
            raise SamplerError(f"row {r} is not in this session of {session.num_rows} rows")

    def generate_from(self, session: Session, max_new_tokens: int | Sequence[int], *,
                      rows: Sequence[int] | None = None, temperature: float = 0.0, top_p: float = 1.0,
                      top_k: int = 0, seed: int | Sequence[int] = 0, stop_strings: Sequence[str] = (),
                      eos_ids: Sequence[int] | None = None, row_ids: Sequence[int] | None = None,
                      step_offset: Sequence[int] | None = None, stop_after: int = 0,
                      min_buffer: int = 0) -> SampleOutput:
        """Writes each selected row's pending tokens, then generates; other rows are left as they are.

        max_new_tokens: one limit for every row, or one per row of `rows` (e.g. what is left of
          each row's response budget in a multi-turn rollout).
        seed, row_ids, step_offset: the sampling keys of each row of `rows` (`sampling.step_keys`):
          one seed or one per row; the row's id (default: session.row_offset + row); the step of its
          first token here (default 0). A caller that continues a row's "paused" turn passes the
          tokens already generated as its step_offset, so the turn draws as if never interrupted.
        stop_after: return once this many rows of `rows` have finished (0 = when all have); the
          others come back with what they generated so far and finish_reason "paused" (their last
          token pending, like any row's), and continue with the next call.
        min_buffer: the decode output buffer holds at least this many tokens per row. The buffer's
          length is a compiled shape (a power of two covering the largest limit); a caller whose
          calls have varying limits below a known cap passes the cap, so they share one program.
        Returns one entry per row of `rows` (default: all rows), in that order.
        """
        if self._weights is None:
            raise SamplerError("the sampler has no weights (release_params was called); call update_params first")
        rows = list(range(session.num_rows)) if rows is None else [int(r) for r in rows]
        if not rows:
            raise SamplerError("rows is empty; pass at least one row to generate for")
        for r in rows:
            self._check_row(session, r)
        if len(set(rows)) != len(rows):
            raise SamplerError(f"rows {rows} has duplicates")
        per_row, seeds, ids, steps = generate_args(
            rows, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            vocab_size=self.vocab_size, seed=seed, row_ids=row_ids, step_offset=step_offset,
            stop_after=stop_after, row_offset=session.row_offset)
        eos = tuple(self.eos_ids if eos_ids is None else eos_ids)
        self._check_ids(eos, "eos id")
        if isinstance(stop_strings, str):
            stop_strings = (stop_strings,)
        stop_strings = tuple(stop_strings)
        tables = self._stop_table(stop_strings) if stop_strings else None

        n = session.num_rows
        lengths = np.array(session.lengths(), np.int64)
        room = self.cache_size - lengths
        sel = np.zeros(n, bool)
        sel[rows] = True
        feed = sel & (room > 0)  # rows at the cache limit generate nothing ("cache_full")
        wanted = np.zeros(n, np.int64)
        wanted[rows] = per_row
        limit = np.where(feed, np.minimum(wanted, room), 0)
        limit_reason = np.where(room <= wanted, loop.CACHE_FULL, loop.LENGTH)
        pending = np.where(feed, lengths - session.cached, 0)
        if feed.any() and (pending[feed] < 1).any():
            bad = int(np.flatnonzero(feed & (pending < 1))[0])
            raise SamplerError(f"row {bad} has no pending token to continue from")

        # Physical cache: every row writes `chunk` slots from its end during a prefill chunk, and
        # finished rows write one scratch slot at their end while others decode.
        chunk = min(self.prefill_chunk, _bucket(int(pending.max(initial=1)), self.buckets, 16))
        final_end = np.where(feed, lengths + limit - 1, lengths)
        need = int(max((session.cached + chunk).max(), final_end.max() + 1))
        device_cache.ensure(self, session, need)
        cache = session.cache
        bp = cache.end.shape[0]

        logits = device_cache.put_batch(self.mesh, np.zeros((bp, self.vocab_size), np.float32))
        cached = np.where(feed, lengths, session.cached)
        logits, cache = device_cache.write(self, session, cache, logits, cached)

        buf_len = _bucket(max(int(limit.max()), min_buffer), None, 16)
        lim = np.zeros(bp, np.int32)
        lim[:n] = limit
        lreason = np.full(bp, loop.LENGTH, np.int32)
        lreason[:n] = limit_reason
        greedy = temperature == 0
        mesh = self.mesh
        row_arg = []
        for values in (seeds, ids, steps):
            full = np.zeros(bp, np.int32)
            full[rows] = values
            row_arg.append(device_cache.put_batch(mesh, full))
        toks, lps, n_gen, reason, cache = device_cache.on_mesh(
            mesh, loop.decode, self._impl, self._weights, cache, logits, device_cache.put_batch(mesh, lim),
            device_cache.put_batch(mesh, lreason),
            device_cache.replicated(mesh, jnp.asarray(eos if eos else (-1,), jnp.int32)), tables,
            jnp.float32(temperature if not greedy else 1.0), jnp.float32(top_p), jnp.int32(top_k),
            *row_arg, device_cache.replicated(mesh, jnp.int32(stop_after or bp)), buf_len=buf_len, greedy=greedy,
            top_k_bucket=0 if greedy or not top_k else min(self.vocab_size, _pow2_at_least(top_k, 8)),
            use_top_p=(not greedy) and top_p < 1.0)
        session.cache = cache
        toks, lps, n_gen, reason = (np.asarray(jax.device_get(x)) for x in (toks, lps, n_gen, reason))

        out_t, out_l, out_r = [], [], []
        for r in rows:
            k = int(n_gen[r])
            gen = toks[r, :k].tolist()
            session.sequences[r].extend(gen)
            if k:
                cached[r] = lengths[r] + k - 1  # the last generated token is pending
            out_t.append(gen)
            out_l.append(lps[r, :k].astype(np.float32))
            out_r.append(PAUSED if int(reason[r]) == loop.RUNNING else FINISH_REASONS[int(reason[r])])
        session.cached = cached
        return SampleOutput(tokens=out_t, logprobs=out_l, finish_reason=out_r)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int = 0, stop_strings: Sequence[str] = (),
                 eos_ids: Sequence[int] | None = None) -> SampleOutput:
        """Generates up to `max_new_tokens` for each prompt (token-id lists of any lengths)."""
        session = self.start(prompts)
        return self.generate_from(session, max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                  seed=seed, stop_strings=stop_strings, eos_ids=eos_ids)


__all__ = ["FINISH_REASONS", "PAUSED", "Sampler", "Session", "SampleOutput", "SamplerError"]
