"""Question files in the Search-R1 / FlashRAG row format: read, check, write.

A row is one question with its gold answers:

    {"id": "train_0", "question": "who wrote ...?", "golden_answers": ["..."], "data_source": "nq"}

- `question` (required): a non-empty string.
- `golden_answers` (required): a list of non-empty strings (numpy arrays in parquet written by
  pandas; a plain string means one answer). Search-R1's processed parquet rows also carry the
  answers as `reward_model.ground_truth.target`; either is accepted, `golden_answers` first.
- `id` (optional): default `<file stem>_<row index>` (row index from 0). Ids are kept as written and
  need not be unique across sources: Search-R1's merged train.parquet numbers NQ and HotpotQA rows
  `train_N` each, so (data_source, id) is the key.
- `data_source` (optional): default the file stem.

Files are `.jsonl` (one JSON object a line; blank lines are skipped) or `.parquet` (read with
pyarrow), local or a URI (gs://bucket/train.jsonl, read through `workflow_r1.storage`). Anything that cannot be used raises `DataError` with one line naming the file and the
line (jsonl, counted from 1) or row (parquet, counted from 0 as in pyarrow and pandas).
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from workflow_r1 import storage

BUNDLED_QUESTIONS = Path(__file__).resolve().parent.parent / "bundled" / "questions.jsonl"
EXTENSIONS = (".jsonl", ".parquet")
# A local data file is read whole into memory; past this it is refused (a data set of 10k questions
# takes a few MB).
MAX_FILE_BYTES = 4 << 30
# Parquet columns a Question is made of; the others (Search-R1's prompt, extra_info, ...) are not read.
_PARQUET_COLUMNS = ("id", "question", "golden_answers", "data_source", "reward_model")
_ANSWERS_HINT = "no 'golden_answers' (a list of gold answer strings)"


class DataError(ValueError):
    """A question file or row that cannot be used; the message names the file, the line and the fix."""


@dataclasses.dataclass(frozen=True)
class Question:
    """One training or evaluation question and the answers the reward accepts."""
    id: str
    question: str
    golden_answers: tuple[str, ...]
    data_source: str

    def to_row(self) -> dict[str, Any]:
        """The Search-R1 row this question reads back from (golden_answers as a list)."""
        return {"id": self.id, "question": self.question,
                "golden_answers": list(self.golden_answers), "data_source": self.data_source}


# --------------------------------------------------------------------------------------------------
# One row -> Question
# --------------------------------------------------------------------------------------------------

def _answers(value: Any) -> tuple[str, ...] | None:
    """A gold-answer field as a tuple of non-empty strings, or None if it is not one."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        return None
    if not all(isinstance(a, str) and a.strip() for a in value):
        return None
    return tuple(value)


def _target(row: dict[str, Any]) -> Any:
    """Search-R1's `reward_model.ground_truth.target`, or None."""
    reward_model = row.get("reward_model")
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    return truth.get("target") if isinstance(truth, dict) else None


def question_from_row(row: Any, *, where: str, default_id: str, default_source: str) -> Question:
    """One row (a dict) as a Question; `where` ("data file x.jsonl line 7") prefixes any error."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object with 'question' and 'golden_answers', "
                        f"got {type(row).__name__}")
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{where}: no 'question' (a non-empty string)")
    answers = _answers(row.get("golden_answers")) or _answers(_target(row))
    if answers is None:
        raise DataError(f"{where}: {_ANSWERS_HINT}")
    qid = row.get("id")
    if qid is None:
        qid = default_id
    elif not isinstance(qid, (str, int)) or isinstance(qid, bool):
        raise DataError(f"{where}: 'id' must be a string or an integer, got {type(qid).__name__}")
    source = row.get("data_source")
    if source is None:
        source = default_source
    elif not isinstance(source, str) or not source:
        raise DataError(f"{where}: 'data_source' must be a non-empty string")
    for name, text in (("question", question), ("id", str(qid)), ("data_source", source),
                       *(("golden_answers", a) for a in answers)):
        _check_encodable(text, where, name)
    return Question(id=str(qid), question=question, golden_answers=answers, data_source=source)


def _check_encodable(text: str, where: str, name: str) -> None:
    """JSON's \\ud800-style escapes decode to lone surrogates, which no tokenizer or file can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(f"{where}: {name!r} holds an unpaired surrogate escape ({text[exc.start]!r} at character "
                        f"{exc.start + 1}); write the character itself or a \\uD83D\\uDE00-style pair") from None


# --------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------

def _check_file(path: storage.Path) -> None:
    if path.suffix not in EXTENSIONS:
        raise DataError(f"data file {path}: unknown extension {path.suffix or '(none)'!r}; "
                        "use .jsonl or .parquet (Search-R1 / FlashRAG rows)")
    with storage.reading(path, "data file", DataError):
        exists, is_file = path.exists(), path.is_file()
    if not exists:
        raise DataError(f"data file {path}: not found")
    if not is_file:
        raise DataError(f"data file {path}: not a file")
    with storage.reading(path, "data file", DataError):
        size = storage.refuse_special(path, "data file", DataError)
    if size > MAX_FILE_BYTES:
        raise DataError(f"data file {path}: {size / 2**30:.1f} GiB, over the {MAX_FILE_BYTES >> 30} GiB read whole "
                        "into memory; split it into several files (comma-separated in data.train_files)")


def _read_jsonl(path: storage.Path) -> list[Question]:
    with storage.reading(path, "data file", DataError):
        data = path.read_bytes()
    out = []
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        where = f"data file {path} line {lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{where}: not UTF-8 text ({exc.reason} at column {exc.start + 1})") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        except RecursionError:  # the C decoder's answer to arrays / objects nested thousands deep
            raise DataError(f"{where}: JSON nested too deeply; a row is one flat object with 'question' and "
                            "'golden_answers'") from None
        out.append(question_from_row(row, where=where, default_id=f"{path.stem}_{len(out)}",
                                     default_source=path.stem))
    return out


def _read_parquet(path: storage.Path) -> list[Question]:
    import pyarrow.parquet as pq  # only parquet users pay for the import

    with storage.reading(path, "data file", DataError):
        f = path.open("rb")  # a URI's file object reads the row groups and columns it asks for
    try:
        with f:
            pf = pq.ParquetFile(f)
            columns = [c for c in _PARQUET_COLUMNS if c in pf.schema_arrow.names]
            rows = pf.read(columns=columns).to_pylist()
    except Exception as exc:  # pyarrow raises several types for a corrupt or foreign file
        raise DataError(f"data file {path}: not a readable parquet file "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    return [question_from_row(row, where=f"data file {path} row {i}", default_id=f"{path.stem}_{i}",
                              default_source=path.stem)
            for i, row in enumerate(rows)]


def read_questions(path: str | os.PathLike) -> list[Question]:
    """The questions of one `.jsonl` or `.parquet` file (a local path or a URI), in file order.

    Raises:
      DataError: one line naming the file as given (and line/row) for a missing, unreadable, empty or
        malformed file.
    """
    path = storage.source(path)
    _check_file(path)
    questions = _read_jsonl(path) if path.suffix == ".jsonl" else _read_parquet(path)
    if not questions:
        raise DataError(f"data file {path}: empty (no question rows)")
    return questions


def bundled_questions() -> list[Question]:
    """The 109 bundled questions (workflow_r1/bundled/questions.jsonl), for tests and smoke runs."""
    return read_questions(BUNDLED_QUESTIONS)


def write_questions(questions: Iterable[Question], path: str | os.PathLike) -> Path:
    """Writes Search-R1 rows to `path` (.jsonl or .parquet) atomically; returns the path."""
    path = Path(path)
    if path.suffix not in EXTENSIONS:
        raise DataError(f"data file {path}: unknown extension {path.suffix or '(none)'!r}; "
                        "write .jsonl or .parquet")
    rows = [q.to_row() for q in questions]
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written next to the target and renamed, so a reader never sees half a file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        if path.suffix == ".jsonl":
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def source_counts(questions: Sequence[Question]) -> dict[str, int]:
    """data_source -> number of questions, sources sorted by name."""
    names, counts = np.unique([q.data_source for q in questions], return_counts=True)
    return {str(n): int(c) for n, c in zip(names, counts)}


def cli_main(run: Callable[[], str]) -> Callable[[Sequence[str]], None]:
    """An absl `main` for the data CLIs: refuses stray arguments, prints what `run` returns, and
    ends a DataError as its one line ("error: ...") with exit status 1 instead of a traceback."""
    def main(argv: Sequence[str]) -> None:
        if len(argv) > 1:
            raise SystemExit(f"error: unexpected arguments {list(argv[1:])}; every input is a --flag")
        try:
            print(run())
        except DataError as exc:
            raise SystemExit(f"error: {exc}") from None
    return main
