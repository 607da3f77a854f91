"""The program tests/test_storage.py runs as 2 JAX processes x 2 CPU devices against the GCS emulator:
what the hosts of a pod do with a bucket.

    python -m workflow_r1.multiprocess --num_processes=2 --devices_per_process=2 -- \\
        tests.gcs_multihost_worker --out=DIR --workdir=gs://bkt/run

On a (data 1, fsdp 2, tensor 2) mesh (fsdp spans the processes, so each host holds half of every
sharded array): builds a tiny model's train state, moves it off its initial values, saves it as
step 3 to `<workdir>/checkpoints` (asynchronously, each host writing its shards), then a fresh
Checkpointer restores it onto an abstract target of the same mesh. Each process compares, shard by
shard, what it restored with what it saved (bit-exact) and writes checkpoint_pI.json to `--out`.

With `--model=gs://...` (the tiny preset's seed-0 model exported there as several safetensors files
and an index), each process first loads it onto the mesh (layers unrolled, then scanned), compares
its shards with the seed-0 model built in memory, and records every byte range it read from the
bucket's safetensors files and any file it opened whole (model_pI.json).
"""
from __future__ import annotations

import argparse
import json
import pathlib

from workflow_r1 import sharding

sharding.maybe_initialize_distributed()  # before anything touches a JAX backend

import jax  # noqa: E402
import numpy as np  # noqa: E402

from workflow_r1 import checkpoint_tree, checkpointing  # noqa: E402
from workflow_r1.model import checkpoint as hf_checkpoint  # noqa: E402
from workflow_r1.model import qwen2  # noqa: E402
from workflow_r1.model.config import get_preset  # noqa: E402
from workflow_r1.rl import train_state  # noqa: E402

CFG = get_preset("tiny")
TCFG = train_state.TrainConfig(learning_rate=1e-2)
MESH = sharding.MeshConfig(data=1, fsdp=2, tensor=2)


def shards(tree) -> list[tuple[str, str, np.ndarray]]:
    """(key path, shard index, this host's data) of every addressable shard of every leaf of `tree`."""
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        for s in sorted(x.addressable_shards, key=lambda s: (str(s.index), s.device.id)):
            out.append((jax.tree_util.keystr(path), f"{s.device.id}:{s.index}", np.asarray(s.data)))
    return out


def checkpoint_scenario(workdir: str) -> dict:
    mesh, _ = sharding.make_meshes(MESH)
    state = train_state.create_train_state(qwen2.create(CFG, seed=0), TCFG, mesh)
    # Not the initial values: a restore that re-initialised anything would differ.
    state = state.replace(params=jax.tree.map(lambda x: x * 1.5 + 0.25, state.params), step=state.step + 3)
    directory = f"{workdir}/checkpoints"
    extra = {"step": 3, "processes": jax.process_count()}
    with checkpointing.Checkpointer(directory, checkpointing.CheckpointConfig(async_save=True)) as c:
        c.save(3, state, extra, force=True)
        c.wait()
    target = checkpoint_tree.abstract_train_state(qwen2.abstract(CFG), TCFG, mesh)
    with checkpointing.Checkpointer(directory) as c:
        steps = c.all_steps()
        restored, got_extra = c.restore(target)
    saved_tree = {"params": state.params, "opt_state": state.opt_state, "step": state.step}
    restored_tree = {"params": restored.params, "opt_state": restored.opt_state, "step": restored.step}
    a, b = shards(saved_tree), shards(restored_tree)
    return {"steps": steps, "extra": got_extra, "shards": len(a),
            "sharded_leaves": sum(not x.is_fully_replicated for x in jax.tree.leaves(saved_tree)),
            "same_layout": [(p, i) for p, i, _ in a] == [(p, i) for p, i, _ in b],
            "mismatched": [p for (p, _, x), (_, _, y) in zip(a, b)
                           if x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x, y)],
            "local_elements": int(sum(x.size for _, _, x in a))}


def model_scenario(uri: str) -> dict:
    from flax import nnx
    from fsspec.implementations.dirfs import DirFileSystem  # the emulator's gs:// (tests/gcs_emulator.py)

    reads, opened = [], []
    real_cat, real_open = DirFileSystem.cat_file, DirFileSystem._open

    def cat_file(self, path, start=None, end=None, **kwargs):
        reads.append([str(path).rsplit("/", 1)[-1], start, end])
        return real_cat(self, path, start=start, end=end, **kwargs)

    def _open(self, path, *args, **kwargs):
        opened.append(str(path).rsplit("/", 1)[-1])
        return real_open(self, path, *args, **kwargs)

    DirFileSystem.cat_file, DirFileSystem._open = cat_file, _open
    try:
        mesh, _ = sharding.make_meshes(MESH)
        unrolled = hf_checkpoint.load(uri, mesh=mesh)
        ranges = list(reads)
        scanned = hf_checkpoint.load(uri, mesh=mesh, scan_layers=True)
    finally:
        DirFileSystem.cat_file, DirFileSystem._open = real_cat, real_open
    reference = nnx.state(qwen2.create(CFG, seed=0), nnx.Param)
    mismatched = []
    for loaded, stacked in ((unrolled, False), (scanned, True)):
        state = nnx.state(loaded, nnx.Param)
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
            keys = [getattr(k, "key", getattr(k, "idx", k)) for k in path][:-1]  # drop the Variable's value
            if stacked and keys[0] == "layers":
                want = np.stack([np.asarray(_at(reference, ["layers", i, *keys[1:]])) for i in range(CFG.num_layers)])
            else:
                want = np.asarray(_at(reference, keys))
            if x.is_fully_addressable:
                mismatched.append(f"on this host only: {jax.tree_util.keystr(path)}")  # the mesh spans both
            for s in x.addressable_shards:
                if not np.array_equal(np.asarray(s.data), want[s.index]):
                    mismatched.append(f"{'scanned' if stacked else 'unrolled'}{jax.tree_util.keystr(path)}")
    return {"reads": ranges, "opened": [f for f in opened if f.endswith(".safetensors")],
            "mismatched": sorted(set(mismatched))}


def _at(tree, keys):
    for k in keys:
        tree = tree[k]
    return tree.get_value() if hasattr(tree, "get_value") else tree


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--model", default="")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    assert jax.process_count() == 2 and jax.device_count() == 4, (jax.process_count(), jax.device_count())
    if args.model:
        (out / f"model_p{jax.process_index()}.json").write_text(json.dumps(model_scenario(args.model)))
    result = checkpoint_scenario(args.workdir)
    (out / f"checkpoint_p{jax.process_index()}.json").write_text(json.dumps(result))
    print(f"worker done on process {jax.process_index()}", flush=True)


if __name__ == "__main__":
    main()
