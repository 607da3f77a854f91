"""Training checkpoints: the `TrainState` and the trainer's resumable state, saved with orbax.

One checkpoint per saved step, `<directory>/<step>/`, holding two items:

- `state`: the trained parameters (all of them, or only the LoRA adapters: the frozen base reloads
  from the model's own checkpoint), the optimizer state and the update count of a `train_step.TrainState`,
  as one tree of arrays (orbax's standard format; each array written by the hosts that own its
  shards, so a checkpoint saved on one mesh restores onto any other).
- `extra`: a JSON dict the trainer fills (data-iterator position, RNG seed and counters, the run
  config), restored as written.

An asynchronous run (`train.max_staleness` > 0) also saves, in the state's tree under
behaviour/v<version>/, the older policy versions its next batches are rolled out by
(`save(behaviour=...)`, `restore_with_versions`; pipeline.py).

Saving is asynchronous by default: `save` returns once the arrays are copied off the devices, and
the files are written in a background thread while training goes on (`wait` blocks until they are
on disk). Orbax writes each step into `<step>.orbax-checkpoint-tmp-<time>/` and renames it to
`<step>/` only when everything is written, so a run killed mid-save leaves a temporary directory
that is never listed as a step (and is deleted when the next `Checkpointer` opens the directory).
A save, and the HF export, first check that the disk has room for what this process writes
(`check_free_space`): a full disk is a one-line error before anything is written, not a partial
step that fails later in the background thread.

The array tree has plain nested dicts with string keys, readable without our classes; how a
`TrainState` becomes that tree and back, and the abstract restore targets (`abstract_train_state`),
are checkpoint_tree.py's. `restore` puts the arrays back into the structure of the target it is
given, on that target's shardings.

The policy can also be exported as a Hugging Face checkpoint (`export_hf`) for vLLM / SGLang.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import shutil
import time
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from workflow_r1 import bounds, sharding, storage
from workflow_r1.checkpoint_tree import abstract_leaf, named_leaves, nest, rebuild, state_items, unflatten_like
from workflow_r1.model import checkpoint as hf_checkpoint
from workflow_r1.model import lora

if TYPE_CHECKING:  # for annotations only
    from workflow_r1.rl.train_state import TrainState

log = logging.getLogger(__name__)

_STATE, _EXTRA = "state", "extra"
EXPORT_DTYPES = ("float32", "bfloat16", "float16")  # what `model.checkpoint.save` writes


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be restored from; the message names it and the fix."""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """The trainer's `checkpoint` config section.

    every_steps: save every this many trainer steps (0: only at the end of the run).
    keep: how many of the most recent checkpoints to keep (older ones are deleted).
    async_save: write the files in a background thread while training continues.
    export_hf: at the end of the run, also export the policy as a Hugging Face checkpoint.
    export_dtype: the dtype of the exported tensors, "float32" | "bfloat16" | "float16", or "" = the
      model's compute dtype (`model.dtype`: bfloat16 for the paper and local presets, so the 7B's
      export is about 15 GB, not 30, and loads as vLLM, SGLang and transformers serve it; float32
      for the tiny ones); fp32 master weights are rounded to the nearest bf16 value.
    """

    every_steps: int = 0
    keep: int = 3
    async_save: bool = True
    export_hf: bool = True
    export_dtype: str = ""

    def __post_init__(self):
        if self.every_steps < 0:
            raise ValueError(f"CheckpointConfig.every_steps must be >= 0 (0: only at the end), got {self.every_steps}")
        if self.keep < 1:
            raise ValueError(f"CheckpointConfig.keep must be >= 1, got {self.keep}")
        bounds.check("checkpoint.every_steps", self.every_steps, 0, bounds.MAX_COUNT, note=" (0: only at the end)")
        bounds.check("checkpoint.keep", self.keep, 1, 1000)
        if self.export_dtype not in ("",) + EXPORT_DTYPES:
            raise ValueError(f"checkpoint.export_dtype={self.export_dtype!r} unknown; use one of {list(EXPORT_DTYPES)} "
                             "or '' (the model's compute dtype)")

    def export_dtype_for(self, compute_dtype: str) -> str:
        """The dtype the HF export writes for a model computing in `compute_dtype` (model.dtype)."""
        return self.export_dtype or compute_dtype


def bytes_written(tree: Any) -> int:
    """Bytes of array data this process writes when saving `tree`: the shards it owns with replica
    id 0 (orbax writes each shard once), or the whole array for host arrays on process 0."""
    total = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            total += sum(s.data.nbytes for s in x.addressable_shards if s.replica_id == 0)
        elif jax.process_index() == 0:
            total += np.asarray(x).nbytes
    return total


def export_bytes(params: Any, dtype: str | None = None) -> int:
    """Bytes of the tensors `export_hf` writes for `params` (all of them, in `dtype` or their own)."""
    size = jnp.dtype(dtype).itemsize if dtype else None
    return sum(x.size * (size or x.dtype.itemsize) for x in jax.tree.leaves(params))


def check_room_for_run(state: TrainState, directory: storage.PathLike, *, export: bool,
                       export_dtype: str | None = None) -> None:
    """Raises CheckpointError (one line) when the disk holding `directory` has no room for the run's
    next checkpoint of `state` (the trained parameters, optimizer state and step; a LoRA base is
    not saved) and, with `export`, the final HF export of its weights in `export_dtype` (None: their
    own): checked before any rollout, since a run that fills its disk at its end loses its last steps."""
    need = bytes_written(state.replace(frozen=None)) + (export_bytes(state.weights(), export_dtype) if export else 0)
    check_free_space(directory, need, "the run's next checkpoint" + (" and its final export" if export else ""))


def check_free_space(path: storage.PathLike, need: int, what: str) -> None:
    """Raises CheckpointError (one line) when the file system holding `path` (or its nearest existing
    parent) has fewer than `need` bytes free, plus 2% and 16 MiB for metadata: a save that would fill
    the disk fails here, before it writes anything, and the checkpoints already on disk stay intact.
    A URI (an object store: no free-space figure) is not checked."""
    if storage.is_remote(path):
        return
    probe = pathlib.Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    check_writable(path, probe)
    free = shutil.disk_usage(probe).free
    margin = need * 0.02 + (16 << 20)
    if free < need + margin:
        raise CheckpointError(f"not enough disk space for {what} in {path}: it needs about {_size(need)} plus a "
                              f"margin of {_size(margin)} (2% and 16 MiB for metadata), {_size(free)} free on {probe}; "
                              "free some space or point --workdir at a larger disk")


def check_writable(path: str | pathlib.Path, probe: pathlib.Path) -> None:
    """Raises CheckpointError (one line) when `path` cannot be created under `probe`, its nearest existing
    parent: a regular file in the way, a read-only file system, or no write permission."""
    if not probe.is_dir():
        raise CheckpointError(f"cannot create {path}: {probe} is a file, not a directory; point --workdir at a "
                              "directory")
    if os.statvfs(probe).f_flag & os.ST_RDONLY:
        raise CheckpointError(f"cannot write {path}: {probe} is on a read-only file system; point --workdir at a "
                              "writable disk")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write {path}: no write permission on {probe}; point --workdir at a "
                              "directory you can write")


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _fmt(path: tuple[str, ...]) -> str:
    return "/".join(path)


def _reason(e: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


class _DropOrbaxTracebacks(logging.Filter):
    """Orbax logs every failure of its writer threads with a traceback (`logging.exception`, once per
    thread) before it re-raises the error to the caller; when several of its write tasks fail, asyncio
    also logs each one nobody awaited ("Task exception was never retrieved"). The Checkpointer turns
    the error into one line, so these copies are kept at DEBUG level only."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or record.levelno < logging.ERROR:
            return True
        # Logged by orbax, or raised inside it.
        files = [record.pathname, *(frame.f_code.co_filename for frame, _ in traceback.walk_tb(record.exc_info[2]))]
        if any("orbax" in f for f in files):
            log.debug("orbax: %s", record.getMessage(), exc_info=record.exc_info)
            return False
        return True


_ORBAX_FILTER = _DropOrbaxTracebacks()
# Orbax logs through absl's logger, asyncio through its own; a logger's filters see only its own records.
logging.getLogger("asyncio").addFilter(_ORBAX_FILTER)
logging.getLogger("absl").addFilter(_ORBAX_FILTER)


# --------------------------------------------------------------------------------------------------
# The checkpointer
# --------------------------------------------------------------------------------------------------

def _items(state: TrainState, behaviour: dict[int, Any]) -> list[tuple[tuple[str, ...], Any]]:
    """The saved arrays: the train state's, then each saved policy version's under behaviour/v<version>."""
    return state_items(state) + [(("behaviour", f"v{v}") + p, x) for v, params in sorted(behaviour.items())
                                 for p, x in named_leaves(params)]


class Checkpointer:
    """Saves and restores `TrainState` + a JSON dict under `directory`, keeping the last `cfg.keep`.

    Every process of a multi-host run must make the same calls (orbax coordinates the writes).
    """

    def __init__(self, directory: storage.PathLike, cfg: CheckpointConfig = CheckpointConfig()):
        self.directory = storage.path(directory, absolute=True)  # a URI stays one (orbax writes it natively)
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, create=True, enable_async_checkpointing=cfg.async_save,
            # A temporary directory left by a killed save is never a step; delete it on start-up.
            cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
            _STATE: ocp.StandardCheckpointHandler(), _EXTRA: ocp.JsonCheckpointHandler()})

    # -- queries ------------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """The finalized steps on disk, ascending (saves still in flight are not listed)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest finalized step on disk, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """True at every `cfg.every_steps`-th step (never when every_steps is 0)."""
        return self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0

    # -- save ---------------------------------------------------------------------------------------

    def save(self, step: int, state: TrainState, extra: dict[str, Any], force: bool = False,
             behaviour: dict[int, Any] | None = None) -> bool:
        """Saves `state` and `extra` as checkpoint `step` if `should_save(step)` or `force`.

        behaviour: {version: parameters} of the older policy versions an asynchronous run's next
        batches are rolled out by (pipeline.py), saved beside the state as behaviour/v<version>/...

        Returns whether a save started. A step already on disk is not saved again. With
        `cfg.async_save` the files are written in the background: the arrays are copied to host
        memory before this returns, so `state` may be donated to the next train step at once.
        `extra` must be JSON-serialisable (checked here, before anything is written).
        """
        if not (force or self.should_save(step)):
            return False
        if step in self._manager.all_steps():
            return False
        # Orbax writes JSON in its background thread; find a bad value here, in the caller's frame.
        try:
            json.dumps(extra)
        except TypeError as e:
            raise TypeError(f"checkpoint extra for step {step} is not JSON-serialisable ({e}); "
                            "store plain ints, floats, strings, lists and dicts (e.g. config.to_dict())") from None
        tree = nest(_items(state, behaviour or {}))
        self.wait()  # a save still in flight has not taken its space yet
        check_free_space(self.directory, bytes_written(tree), f"checkpoint step {step}")
        t0 = time.perf_counter()
        try:
            saved = self._manager.save(step, args=ocp.args.Composite(
                **{_STATE: ocp.args.StandardSave(tree), _EXTRA: ocp.args.JsonSave(extra)}), force=True)
        except Exception as e:  # a synchronous save (or its start) that hits a full or read-only disk
            raise self._write_error(e) from e
        log.info("checkpoint step %d: %s in %.2f s%s", step, self.directory / str(step), time.perf_counter() - t0,
                 " (writing in the background)" if self.cfg.async_save else "")
        return bool(saved)

    # -- restore ------------------------------------------------------------------------------------

    def restore(self, target: TrainState, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """`restore_with_versions` without saved policy versions: (state, extra)."""
        state, extra, _ = self.restore_with_versions(target, step)
        return state, extra

    def restore_with_versions(self, target: TrainState, step: int | None = None, versions: Sequence[int] = (),
                              ) -> tuple[TrainState, dict[str, Any], dict[int, Any]]:
        """Restores checkpoint `step` (default: the latest) onto the structure and shardings of `target`.

        `target` is a `TrainState` of the same model and optimizer: a real one (e.g. freshly created,
        its arrays are not modified) or `checkpoint_tree.abstract_train_state(...)` (ShapeDtypeStructs
        with shardings).
        Arrays land on the target's shardings, whatever mesh the checkpoint was saved from, and in
        the target's dtypes. `versions`: the saved policy versions (`save`'s behaviour) to restore too,
        onto the structure of `target.params`. Returns (state, extra, {version: parameters}).

        Raises CheckpointError (one line: the path and the fix) when the directory has no
        checkpoint, the step does not exist, the saved shapes do not match `target` (another
        model), or the files are corrupt or partial.
        """
        self.wait()
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}; point the run at a directory with a saved "
                                  "step, or start without restoring")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory} (steps on disk: {steps}); "
                                  "pass one of those or None for the latest")
        path = self.directory / str(step)
        items = _items(target, {v: target.params for v in versions})
        self._check_matches(path, step, items)
        abstract = nest([(p, abstract_leaf(x)) for p, x in items])
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                **{_STATE: ocp.args.StandardRestore(abstract), _EXTRA: ocp.args.JsonRestore()}))
            state = unflatten_like(target, restored[_STATE])
            behaviour = {v: rebuild(f"v{v}", target.params, restored[_STATE]["behaviour"]) for v in versions}
            extra = restored[_EXTRA]
        except CheckpointError:
            raise
        except Exception as e:  # orbax / tensorstore raise many types for unreadable files
            raise CheckpointError(f"checkpoint {path} cannot be read ({_reason(e)}); it is corrupt "
                                  f"or partial: delete {path} to resume from the step before it") from e
        return state, (extra or {}), behaviour

    def _check_matches(self, path: storage.Path, step: int, items: list[tuple[tuple[str, ...], Any]]) -> None:
        """Raises CheckpointError unless the saved array tree has the target's paths and shapes."""
        try:
            meta = self._manager.item_metadata(step)[_STATE]
            if meta is None:  # orbax's answer for a missing or unreadable _METADATA file
                raise FileNotFoundError(path / _STATE / "_METADATA")
            saved = {p: tuple(m.shape) for p, m in named_leaves(meta.tree if hasattr(meta, "tree") else meta)}
        except Exception as e:
            raise CheckpointError(f"checkpoint {path} has no readable state metadata ({_reason(e)}); it "
                                  f"is corrupt or partial: delete {path} to resume from the step before it") from e
        wanted = {p: tuple(np.shape(x)) for p, x in items}
        for p, shape in wanted.items():
            if p not in saved and p[0] == "behaviour":
                raise CheckpointError(f"checkpoint {path} has no saved policy version {p[1][1:]}: it was saved with "
                                      "another train.max_staleness; resume with the value it was saved with, or "
                                      "use a new directory")
            if p not in saved:
                raise CheckpointError(f"checkpoint {path} has no array {_fmt(p)}: it was saved from another model or "
                                      "optimizer; restore with the run's own model config, or use a new directory")
            if saved[p] != shape:
                raise CheckpointError(f"checkpoint {path}: {_fmt(p)} has shape {list(saved[p])} but the model has "
                                      f"{list(shape)}: it was saved from another model (preset); restore with the "
                                      "run's own model config, or use a new directory")
        unused = sorted(set(saved) - set(wanted), key=lambda p: (p[0] != "params", p))  # name a parameter first
        if unused and unused[0][0] == "behaviour":
            raise CheckpointError(f"checkpoint {path} holds policy version {unused[0][1][1:]} for asynchronous "
                                  "training: it was saved with another train.max_staleness; resume with the value "
                                  "it was saved with, or use a new directory")
        if unused:
            raise CheckpointError(f"checkpoint {path} has array {_fmt(unused[0])} that the model does not have: it was "
                                  "saved from another model or optimizer; restore with the run's own model config, "
                                  "or use a new directory")

    # -- lifetime -----------------------------------------------------------------------------------

    def wait(self) -> None:
        """Blocks until every save in flight is on disk (finalized).

        Raises CheckpointError (one line) when a background save failed, e.g. the disk filled or went
        read-only while it was written: that step is not on disk, the ones before it are intact.
        """
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # OSError from the writer threads, or what orbax wraps it in
            raise self._write_error(e) from e

    def close(self) -> None:
        """Waits for saves in flight and releases orbax's threads (CheckpointError as in `wait`)."""
        try:
            self._manager.close()
        except Exception as e:
            raise self._write_error(e) from e

    def _write_error(self, e: BaseException) -> CheckpointError:
        try:
            steps = self.all_steps()
        except Exception:  # a file system that cannot even be listed
            steps = []
        return CheckpointError(f"a checkpoint could not be written to {self.directory} ({_reason(e)}); "
                               + (f"step {steps[-1]} is the newest intact one" if steps else "no step is on disk yet")
                               + "; free space (or fix the file system) and rerun the same command to resume")

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def restore_params(directory: storage.PathLike, params: Any, step: int | None = None) -> tuple[Any, int]:
    """(the policy parameters of checkpoint `step`, the step) of a run's checkpoint directory.

    Only the parameters are read (not the optimizer state): what evaluation needs, without building
    an optimizer. `params` is the target (e.g. `nnx.split(model)[1]` of the run's model): the
    arrays land in its structure, dtypes and shardings. Default step: the newest. Raises
    CheckpointError (one line) when there is no such step or the files do not fit the target.
    """
    directory = storage.path(directory, absolute=True)
    steps = Checkpointer(directory, CheckpointConfig(async_save=False))
    try:
        on_disk = steps.all_steps()
        if not on_disk or (step is not None and step not in on_disk):
            raise CheckpointError(f"no checkpoint{'' if step is None else f' for step {step}'} in {directory} "
                                  f"(steps on disk: {on_disk}); point --checkpoint at a run's checkpoints")
        step = on_disk[-1] if step is None else step
        items = [(("params",) + p, x) for p, x in named_leaves(params)]
        abstract = nest([(p, abstract_leaf(x)) for p, x in items])
    finally:
        steps.close()
    manager = ocp.CheckpointManager(directory, item_handlers={_STATE: ocp.PyTreeCheckpointHandler()})
    try:
        restored = manager.restore(step, args=ocp.args.Composite(**{_STATE: ocp.args.PyTreeRestore(
            abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract), partial_restore=True)}))
    except Exception as e:  # orbax / tensorstore raise many types for unreadable or foreign files
        raise CheckpointError(f"checkpoint {directory / str(step)}: the policy parameters cannot be read "
                              f"({_reason(e)}); restore with the run's own model config") from e
    finally:
        manager.close()
    return rebuild("params", params, restored[_STATE]), step


# --------------------------------------------------------------------------------------------------
# Hugging Face export
# --------------------------------------------------------------------------------------------------

def export_hf(state: TrainState, out_dir: storage.PathLike, tokenizer_dir: str | pathlib.Path | None = None, *,
              dtype: str | None = None, tokenizer: Any = None) -> storage.Path:
    """Writes the policy of `state` as a Hugging Face checkpoint directory (config.json, safetensors,
    and the tokenizer / generation files of `tokenizer_dir`), loadable by vLLM, SGLang, transformers
    and `model.checkpoint.load`.

    dtype: "float32" | "bfloat16" | "float16", or None to keep the parameter dtype.
    LoRA adapters are merged into their kernels (W + scale · A B in fp32, then rounded to `dtype`).
    Every parameter is gathered to this host, one at a time. Multi-host: every process must call
    this (parameters sharded over several hosts are gathered first); only process 0 writes.
    tokenizer: a transformers tokenizer saved beside the weights (when `tokenizer_dir` has none).
    `out_dir` may be a URI: the files are written locally first (free space checked there) and copied.
    """
    graphdef, params = nnx.split(lora.merge(state.model(), dtype=dtype))
    if jax.process_count() > 1:
        one_device = sharding.make_mesh(1, 1, 1, devices=jax.local_devices()[:1])
        params = sharding.copy_to_mesh(params, sharding.state_shardings(params, one_device))
    if jax.process_index() != 0:
        return storage.path(out_dir)
    with storage.staged(out_dir) as local:  # a URI is written locally first: its space is checked there
        check_free_space(local, export_bytes(params, dtype), "the Hugging Face export")
        hf_checkpoint.save(nnx.merge(graphdef, params), local, dtype=dtype, extra_files_from=tokenizer_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(local))
    return storage.path(out_dir)


__all__ = ["CheckpointConfig", "CheckpointError", "Checkpointer", "bytes_written", "check_free_space",
           "check_writable", "export_bytes", "export_hf"]
