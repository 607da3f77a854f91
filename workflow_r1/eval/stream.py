"""Episodes of an evaluation streamed to disk as they finish, so an interrupted run resumes from them.

`python -m workflow_r1.evaluate` rolls out its questions batch by batch; after each batch the
finished episodes are appended to `<out>/stream.host<i>.jsonl` (one JSON line per episode, the whole
`Episode`: question, turns, tokens, reward), flushed and fsync-ed. A restart with the same
evaluation reads that file back, keeps the episodes whose question is still the same one at the
same position, and rolls out only the rest; greedy rollouts of the same batches give the same
episodes, so the merged result equals an uninterrupted run's.

The file's first line is a header naming what is evaluated (`fingerprint`: method, checkpoint, data,
config, batch size); a stream of another evaluation is discarded, never mixed in. A torn last line
(a kill mid-write) is dropped. Once the report is written the stream is deleted (`finish`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import tempfile
from collections.abc import Sequence
from typing import Any

from workflow_r1.data.questions import Question
from workflow_r1.rollout.episode import Episode, Turn

log = logging.getLogger(__name__)


def episode_record(e: Episode) -> dict[str, Any]:
    """Every field of `e` as JSON-serialisable values (the question as its row)."""
    d = {f.name: getattr(e, f.name) for f in dataclasses.fields(e) if f.name not in ("question", "turns")}
    return {**d, "question": e.question.to_row(), "turns": [dataclasses.asdict(t) for t in e.turns]}


def episode_from_record(d: dict[str, Any]) -> Episode:
    """The inverse of `episode_record`."""
    q = d["question"]
    question = Question(id=q["id"], question=q["question"], golden_answers=tuple(q["golden_answers"]),
                        data_source=q["data_source"])
    rest = {k: v for k, v in d.items() if k not in ("question", "turns")}
    return Episode(question=question, turns=[Turn(**t) for t in d["turns"]], **rest)


class EpisodeStream:
    """The stream file of one host: `done` (episodes restored, in question order) and `append`.

    questions: this host's questions in the order they are rolled out.
    fingerprint: what is evaluated; a file with another fingerprint is started afresh.
    """

    def __init__(self, path: str | pathlib.Path, fingerprint: dict[str, Any], questions: Sequence[Any]):
        self.path = pathlib.Path(path)
        self.header = {"fingerprint": json.loads(json.dumps(fingerprint, sort_keys=True, default=str))}
        self.done: list[Episode] = self._read(questions)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Rewritten with what is kept (a torn line or a foreign stream never stays in the file).
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            f.write(json.dumps(self.header, sort_keys=True) + "\n")
            f.writelines(json.dumps(episode_record(e), ensure_ascii=False) + "\n" for e in self.done)
        tmp.replace(self.path)
        self._file = self.path.open("a", encoding="utf-8")

    def _read(self, questions: Sequence[Any]) -> list[Episode]:
        if not self.path.exists():
            return []
        lines = self.path.read_text(encoding="utf-8").splitlines()
        try:
            header = json.loads(lines[0]) if lines else None
        except json.JSONDecodeError:
            header = None
        if header != self.header:
            log.warning("%s holds episodes of another evaluation (method, checkpoint, data or config differ); "
                        "starting afresh", self.path)
            return []
        done: list[Episode] = []
        for line in lines[1:]:
            try:
                e = episode_from_record(json.loads(line))
            except (json.JSONDecodeError, KeyError, TypeError):  # the torn last line of a killed run
                break
            if len(done) >= len(questions) or _key(e.question) != _key(questions[len(done)]):
                break
            done.append(e)
        return done

    def append(self, episodes: Sequence[Episode]) -> None:
        """Appends finished episodes and makes them durable before the next batch starts."""
        self._file.writelines(json.dumps(episode_record(e), ensure_ascii=False) + "\n" for e in episodes)
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def finish(self) -> None:
        """Closes and deletes the stream (its episodes are in the report now)."""
        self.close()
        self.path.unlink(missing_ok=True)


def stream_path(out_dir: str | os.PathLike) -> pathlib.Path:
    """This host's stream file for an evaluation writing to `out_dir`: in `out_dir` when it is local;
    for a URI `out_dir` (an object store cannot append) in a local directory named after it, so a
    rerun on this machine resumes."""
    import jax

    from workflow_r1 import storage

    if storage.is_remote(out_dir):
        key = hashlib.sha1(os.fspath(out_dir).encode()).hexdigest()[:16]
        base = pathlib.Path(tempfile.gettempdir()) / "workflow_r1-eval-streams" / key
    else:
        base = pathlib.Path(out_dir)
    return base / f"stream.host{jax.process_index()}.jsonl"


def remove(out_dir: str | os.PathLike) -> None:
    """Deletes this host's stream once the report holds its episodes (host 0 wrote the report after
    the merge, which every host waited for)."""
    stream_path(out_dir).unlink(missing_ok=True)


def _key(q: Any) -> tuple[str, str, str]:
    return (q.data_source, q.id, q.question)
