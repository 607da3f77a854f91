"""One evaluation job: a policy source, question files and a method in, an `EvalResult` and its meta out.

`python -m workflow_r1.evaluate` is this module behind flags; the pieces it assembles (policy
source, sampler, rollout engine or baseline engine, executor, episode stream) are the trainer's own.
"""
from __future__ import annotations

import pathlib
from typing import Any


def default_out(checkpoint: str, method: str) -> Any:
    """<checkpoint>/eval-<method> (a URI stays one: `storage.path`), or runs/eval-<method>."""
    from workflow_r1 import storage

    return storage.path(checkpoint or "runs") / f"eval-{method}"


def evaluate_run(run: Any, *, checkpoint: str = "", data: str = "", method: str = "workflow",
                 stream_dir: str | pathlib.Path | None = None) -> tuple[Any, dict[str, Any]]:
    """(EvalResult, meta) of `method` on `data` with the policy of `checkpoint` under `run` (a
    `run_config.Run`: its model, rollout, env, executor, data and eval sections; `eval.batch_size`
    questions roll out together per host, at most `eval.max_questions` of them, 0 = all).

    stream_dir: where each host streams its finished episodes (`eval.stream`), and from which an
    interrupted evaluation of the same method, checkpoint, data and config resumes; None: in memory
    only. meta["resumed"]: questions restored from the stream (this host's).
    """
    import jax

    from workflow_r1 import envs, memory_fit, sharding
    from workflow_r1.data.config import load_questions
    from workflow_r1.eval import baselines, evaluate, greedy, policy_source, stream
    from workflow_r1.metrics import progress
    from workflow_r1.rollout import RolloutEngine
    from workflow_r1.sampler import Sampler

    setup = envs.make(run)  # env.kind: the evaluation questions and the environment
    questions = load_questions(data) if data else setup.questions()[1]
    limit = run.eval.max_questions
    questions = questions[:limit] if limit else questions
    if not questions:
        raise ValueError("no evaluation questions; pass --data=FILE.jsonl,... or set data.eval_files")
    # The run's meshes: evaluation places the weights as the trainer did.
    mesh, rollout_mesh = sharding.make_meshes(run.mesh, sampler_tensor=run.rollout.tensor_parallel)
    model, tokenizer, what = policy_source.load(checkpoint, run.model, mesh=mesh)
    # As in training: on several hosts each samples its own slice on its own devices.
    sampler = Sampler(model, tokenizer, cache_size=run.rollout.cache_size,
                      mesh=rollout_mesh, dtype=run.rollout.sampler_dtype or None,
                      weights_dtype=run.rollout.weights_dtype or None,
                      paged_attention=run.rollout.paged_attention,
                      ragged=run.rollout.max_tokens_per_step > 0)
    # Before any question is rolled out: a pool the memory cannot hold is one line, not a swapping host.
    memory_fit.check_rollouts(run.rollout, sampler, train_rows=0, eval_rows=run.eval.batch_size)
    episodes = None
    try:
        engine = (RolloutEngine(sampler, run.rollout, setup.environment(tokenizer)) if method == "workflow"
                  else baselines.baseline_engine(method, sampler, tokenizer, run.rollout))
        mine = greedy.host_slice(len(questions), jax.process_index(), jax.process_count())
        batch_size = run.eval.batch_size
        fingerprint = {"method": method, "checkpoint": checkpoint, "policy": what, "data": data,
                       "batch_size": batch_size, "hosts": jax.process_count(),
                       "config": run.raw.to_dict() if run.raw is not None else None}
        episodes = (stream.EpisodeStream(stream.stream_path(stream_dir), fingerprint, questions[mine])
                    if stream_dir is not None else None)
        done = episodes.done if episodes is not None else []
        with progress(mine.stop - mine.start, f"eval {method}") as bar:
            bar.update(len(done))
            result = evaluate(engine, questions, batch_size=batch_size, done=done,
                              on_batch=episodes.append if episodes is not None else None,
                              progress=lambda n, em: (bar.update(n - bar.n), bar.set_postfix(em=f"{em:.3f}")))
    finally:
        setup.close()
        if episodes is not None:
            episodes.close()
    meta = {"method": method, "checkpoint": checkpoint, "policy": what, "data": data or "config evaluation set",
            "executor": (run.executor.url or f"embedded {run.executor.llm}") if method == "workflow" else None,
            "config": run.raw.to_dict() if run.raw is not None else None, "resumed": len(done)}
    return result, meta
