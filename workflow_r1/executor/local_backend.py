"""The executor LLM in this process: `LocalBackend` batches concurrent requests into one call of a
synchronous `generate_fn(prompts, max_tokens) -> [(text, finish_reason[, tokens])]` run in one
worker thread; `load_sampler` and `make_local_generate_fn` build that function over our JAX sampler
from an HF checkpoint directory (`--llm local:DIR`). JAX is imported only inside those two, so an
executor that calls a remote LLM never starts it. The interface (`Completion`, `BackendError`) is
backends.py's.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from workflow_r1.executor.backends import BackendError, Completion

if TYPE_CHECKING:  # JAX is imported lazily (see load_sampler)
    import jax

    from workflow_r1.sampler import Sampler

GenerateFn = Callable[[list[str], int], Sequence[tuple]]


@dataclass
class _Pending:
    prompt: str
    max_tokens: int
    future: asyncio.Future = field(repr=False)


@dataclass
class _LoopQueue:
    """The requests of one event loop and the task that batches them (asyncio objects are bound to
    the loop that made them)."""
    wakeup: asyncio.Event
    worker: asyncio.Task | None = None
    queue: list[_Pending] = field(default_factory=list)


class LocalBackend:
    """Serve an in-process model by batching concurrent requests into one `generate_fn` call.

    `generate_fn(prompts: list[str], max_tokens: int) -> list[(text, finish_reason)]` (a third
    element, the completion token count, is optional) is synchronous and runs in one dedicated
    worker thread, one batch at a time, so the event loop keeps serving while the model generates.
    A batch is formed from the requests waiting when the worker becomes free: it starts at the
    oldest request, waits up to `max_wait_ms` for more to arrive, and holds at most `max_batch`
    requests that share one `max_tokens`.

    One backend may serve several event loops (rlmopt's optimizer on the main loop and an
    in-process executor's loop in its thread share one loaded model): each loop gets its own queue
    and batching task, and the single worker thread runs their batches one at a time. `aclose`
    releases the calling loop's share; the worker thread stops when no loop is left, and a later
    request starts it again (so closing one user of a shared model does not break the others).
    """

    name = "local"

    def __init__(self, generate_fn: GenerateFn, max_batch: int = 32, max_wait_ms: float = 5.0):
        if max_batch < 1:
            raise ValueError(f"LocalBackend max_batch must be >= 1, got {max_batch}")
        self.generate_fn = generate_fn
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000.0
        self.batch_sizes: list[int] = []  # one entry per generate_fn call, for metrics and tests
        self._loops: dict[asyncio.AbstractEventLoop, _LoopQueue] = {}
        self._lock = threading.Lock()  # _loops and _pool are shared by the loops' threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _loop_queue(self) -> _LoopQueue:
        loop = asyncio.get_running_loop()
        with self._lock:
            for other in [lp for lp in self._loops if lp.is_closed()]:
                del self._loops[other]
            lq = self._loops.get(loop)
            if lq is None:
                lq = self._loops[loop] = _LoopQueue(asyncio.Event())
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="local-llm")
        if lq.worker is None or lq.worker.done():
            lq.worker = loop.create_task(self._batch_loop(lq))
        return lq

    async def complete(self, prompt: str, max_tokens: int) -> Completion:
        lq = self._loop_queue()
        pending = _Pending(prompt, max_tokens, asyncio.get_running_loop().create_future())
        lq.queue.append(pending)
        lq.wakeup.set()
        return await pending.future

    def _take_batch(self, lq: _LoopQueue) -> list[_Pending]:
        head = lq.queue[0]
        batch = [p for p in lq.queue if p.max_tokens == head.max_tokens][: self.max_batch]
        chosen = {id(p) for p in batch}
        lq.queue = [p for p in lq.queue if id(p) not in chosen]
        return batch

    async def _batch_loop(self, lq: _LoopQueue) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await lq.wakeup.wait()
            lq.wakeup.clear()
            while lq.queue:
                if len(lq.queue) < self.max_batch and self.max_wait_s > 0:
                    await asyncio.sleep(self.max_wait_s)  # let concurrent requests join the batch
                lq.queue = [p for p in lq.queue if not p.future.done()]  # drop cancelled
                if not lq.queue:
                    break
                batch = self._take_batch(lq)
                self.batch_sizes.append(len(batch))
                prompts = [p.prompt for p in batch]
                try:
                    with self._lock:
                        pool = self._pool
                    if pool is None:
                        raise RuntimeError("the backend was closed")
                    outputs = await loop.run_in_executor(
                        pool, self.generate_fn, prompts, batch[0].max_tokens)
                    if len(outputs) != len(batch):
                        raise ValueError(
                            f"generate_fn returned {len(outputs)} outputs for {len(batch)} prompts")
                    results = [_to_completion(out) for out in outputs]
                except Exception as exc:  # the model failing must not kill the server
                    error = BackendError("llm_error", f"local generate_fn failed: "
                                                      f"{type(exc).__name__}: {exc}")
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(error)
                    continue
                for p, result in zip(batch, results):
                    if not p.future.done():
                        p.future.set_result(result)

    async def aclose(self) -> None:
        """Stops the calling loop's batching task; the worker thread too when no loop is left."""
        with self._lock:
            lq = self._loops.pop(asyncio.get_running_loop(), None)
            live = [lp for lp in self._loops if not lp.is_closed()]
            pool = self._pool if not live else None
            if pool is not None:
                self._pool = None
        if lq is not None and lq.worker is not None:
            lq.worker.cancel()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _to_completion(out: tuple) -> Completion:
    text, finish = out[0], out[1]
    tokens = int(out[2]) if len(out) > 2 else 0
    return Completion(text=str(text), finish_reason=str(finish), tokens=tokens)


# JAX is imported only inside the two functions below, so executors that call a remote LLM never
# start it.

def load_sampler(checkpoint_dir: str, *, dtype: Any = None, mesh: jax.sharding.Mesh | None = None,
                 **kw: Any) -> Sampler:
    """Loads an HF checkpoint directory (weights + tokenizer; a local path or a URI such as
    gs://bucket/model, read in place) into a `workflow_r1.sampler.Sampler`.

    dtype: weights and compute dtype, a dtype or its name (default float32); mesh: a
    jax.sharding.Mesh to shard over. Extra keywords go to `Sampler` (cache_size, impl, ...).
    """
    import jax.numpy as jnp

    from workflow_r1.model import checkpoint
    from workflow_r1.model import tokenizer as tokenizer_lib
    from workflow_r1.sampler import Sampler

    dtype = jnp.float32 if dtype is None else jnp.dtype(dtype)
    model = checkpoint.load(checkpoint_dir, mesh=mesh, dtype=dtype, param_dtype=dtype)
    tokenizer = tokenizer_lib.load(checkpoint_dir)  # from the directory only (local or a URI), never a hub
    return Sampler(model, tokenizer, mesh=mesh, **kw)


def make_local_generate_fn(checkpoint_dir: str, *, temperature: float = 0.0, top_p: float = 1.0,
                           top_k: int = 0, seed: int = 0, stop_strings: Sequence[str] = (),
                           **sampler_kw: Any) -> GenerateFn:
    """generate_fn over our JAX sampler for `--llm local:DIR` (greedy by default, stop at EOS).

    `generate_fn(prompts: list[str], max_tokens: int) -> list[(text, finish_reason)]`: each prompt
    becomes a single user message with the chat template applied. Extra keywords go to
    `load_sampler` / `Sampler` (dtype, cache_size, mesh, ...). The sampler is `generate_fn.sampler`.
    """
    from workflow_r1.sampler.text import generate_text
    sampler = load_sampler(checkpoint_dir, **sampler_kw)

    def generate_fn(prompts: list[str], max_tokens: int) -> list[tuple[str, str]]:
        if not prompts:
            return []
        return generate_text(sampler, list(prompts), max_tokens, temperature=temperature, top_p=top_p,
                             top_k=top_k, seed=seed, stop_strings=stop_strings)

    generate_fn.sampler = sampler
    return generate_fn
