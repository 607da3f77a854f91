"""The program tests/test_multihost.py runs as 1 process x 4 devices and as 2 processes x 2 devices.

    python -m workflow_r1.multiprocess --num_processes=2 --devices_per_process=2 -- \\
        tests.multihost_worker --out=DIR [--restore_from=CKPT_DIR] [--kill_after_save=1]

Every process runs the same code, as on a TPU pod. What each does, on a (data 1, fsdp 2, tensor 2)
mesh (with 2 processes the fsdp axis spans them, tensor stays inside one; parameters, optimizer
moments and batch rows are split across hosts):

- data: draws 4 batches of a QuestionIterator, then a fresh iterator resumed at step 2 draws 2;
  each process writes the ids of its slices (data_pI.json).
- step: 2 sharded train steps of a tiny random model on a fixed global batch of 8 rows, each host
  passing only its rows to `shard_batch`; process 0 writes the gathered batch, losses, grad norms,
  parameters and optimizer state (step.npz).
- sampler: each host generates its rows of 4 prompts (temperature 1) on a mesh of its own devices
  from the globally sharded parameters (sampler_pI.json).
- checkpoint: saves the trained state as step 2 (ckpt/); with --restore_from, first restores that
  directory's step 2 onto this mesh and writes what it got (restored.npz); with
  --kill_after_save=I, process I is SIGKILLed right after starting the save of step 3.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal

from workflow_r1 import sharding

sharding.maybe_initialize_distributed()  # before anything touches a JAX backend

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from workflow_r1 import checkpoint_tree, checkpointing  # noqa: E402
from workflow_r1.data.iterator import QuestionIterator  # noqa: E402
from workflow_r1.data.questions import Question  # noqa: E402
from workflow_r1.model import qwen2  # noqa: E402
from workflow_r1.model.config import get_preset  # noqa: E402
from workflow_r1 import trajectory  # noqa: E402
from workflow_r1.rl import train_state, train_step as ts  # noqa: E402
from workflow_r1.sampler import Sampler  # noqa: E402

CFG = get_preset("tiny")
TCFG = train_state.TrainConfig(learning_rate=1e-2, num_mini_batches=2, micro_batch_size=2, kl_coef=0.0,
                               entropy_coef=0.01)
MESH = sharding.MeshConfig(data=1, fsdp=2, tensor=2)
ROWS, LENGTH = 8, 16


def global_batch(seed: int) -> trajectory.TrainBatch:
    """The same 8-row batch on every process (a function of the seed only)."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(2, CFG.vocab_size, (ROWS, LENGTH))
    loss_mask = np.zeros((ROWS, LENGTH), np.int32)
    for r in range(ROWS):
        loss_mask[r, 5:5 + 3 + r] = 1
    return trajectory.make_batch(tokens, loss_mask, rng.randn(ROWS).astype(np.float32),
                                sampler_logprobs=-rng.rand(ROWS, LENGTH).astype(np.float32))


def host_rows(tree):
    """This host's block of rows of a [B, ...] tree: rows [h*B/P, (h+1)*B/P)."""
    h, p = jax.process_index(), jax.process_count()
    return jax.tree.map(lambda x: x[h * x.shape[0] // p:(h + 1) * x.shape[0] // p], tree)


def gathered(tree) -> dict[str, np.ndarray]:
    """Every array of `tree` in full, on every process, as {key path: NumPy array}."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    full = multihost_utils.process_allgather([x for _, x in flat], tiled=True)
    return {jax.tree_util.keystr(p): np.asarray(x) for (p, _), x in zip(flat, full)}


def write_json(out: pathlib.Path, name: str, value) -> None:
    (out / f"{name}_p{jax.process_index()}.json").write_text(json.dumps(value))


def data_scenario(out: pathlib.Path) -> None:
    questions = [Question(id=f"q{i}", question=f"question {i}?", golden_answers=("a",), data_source="t")
                 for i in range(20)]

    def make():
        return QuestionIterator(questions, 4, seed=5, process_index=jax.process_index(),
                                process_count=jax.process_count())

    it = make()
    drawn = [[q.id for q in it.next()] for _ in range(4)]
    resumed = make()
    resumed.set_state(json.loads(json.dumps({**it.get_state(), "step": 2})))
    write_json(out, "data", {"drawn": drawn, "resumed": [[q.id for q in resumed.next()] for _ in range(2)]})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--restore_from", default="")
    parser.add_argument("--kill_after_save", type=int, default=-1)
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    assert jax.device_count() == 4, f"expected 4 devices in all, got {jax.device_count()}"
    primary = jax.process_index() == 0

    data_scenario(out)

    mesh, _ = sharding.make_meshes(MESH)
    state = train_state.create_train_state(qwen2.create(CFG, seed=0), TCFG, mesh)
    step_fn = ts.make_train_step(TCFG, mesh)
    ckpt = checkpointing.Checkpointer(out / "ckpt", checkpointing.CheckpointConfig(keep=5, async_save=True))

    if args.restore_from:
        with checkpointing.Checkpointer(args.restore_from) as source:
            target = checkpoint_tree.abstract_train_state(qwen2.abstract(CFG), TCFG, mesh)
            restored, extra = source.restore(target, 2)
        got = gathered({"params": restored.params, "opt_state": restored.opt_state, "step": restored.step})
        if primary:
            np.savez(out / "restored.npz", **got, extra=json.dumps(extra))

    record: dict[str, list] = {"loss": [], "grad_norm": []}
    batches = []
    for seed in (1, 2):
        batch = trajectory.shard_batch(host_rows(global_batch(seed)), mesh)
        batches.append(gathered(batch))
        state, metrics = step_fn(state, batch)
        metrics = jax.device_get(metrics)
        record["loss"].append(np.asarray(metrics["loss"]))
        record["grad_norm"].append(np.asarray(metrics["grad_norm"]))
    params = gathered({"params": state.params, "opt_state": state.opt_state, "step": state.step})
    if primary:
        np.savez(out / "step.npz", loss=np.stack(record["loss"]), grad_norm=np.stack(record["grad_norm"]),
                 **{f"batch{i}{k}": v for i, b in enumerate(batches) for k, v in b.items()}, **params)

    ckpt.save(2, state, {"step": 2, "processes": jax.process_count()}, force=True)
    ckpt.wait()

    # Sampler: this host's rows on this host's devices, from the globally sharded parameters.
    prompts = [[3 + i, 40 + 7 * i, 90 + i, 11] for i in range(4)]
    k = jax.process_index() * len(prompts) // jax.process_count()
    mine = prompts[k:k + len(prompts) // jax.process_count()]
    sampler = Sampler(state.model(), cache_size=64, mesh=sharding.host_mesh(MESH.tensor))
    session = sampler.start(mine, row_offset=k)
    gen = sampler.generate_from(session, 12, temperature=1.0, seed=7)
    write_json(out, "sampler", {"tokens": gen.tokens, "logprobs": [lp.tolist() for lp in gen.logprobs]})

    if args.kill_after_save >= 0:
        moved = state.replace(params=jax.tree.map(lambda x: x + 1, state.params), step=state.step + 1)
        ckpt.save(3, moved, {"step": 3, "processes": jax.process_count()}, force=True)
        if jax.process_index() == args.kill_after_save:
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.wait()
    ckpt.close()
    print(f"worker done on process {jax.process_index()}", flush=True)


if __name__ == "__main__":
    main()
