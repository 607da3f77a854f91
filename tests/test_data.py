"""workflow_r1.data: question readers and their one-line errors, the paper's training mix against
pandas, the TFDS array_record round trip without TensorFlow, the checkpointable batch iterator and
the train / eval split."""

import dataclasses
import itertools
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from workflow_r1 import configlib
from workflow_r1.data import (DataConfig, DataError, Question, QuestionIterator, bundled_questions,
                              load_data, load_questions, read_questions, split_train_eval,
                              write_questions)
from workflow_r1.data import mix, questions

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _search_r1_rows(n_nq, n_hotpot):
    """Rows shaped like Search-R1's processed nq_hotpotqa_train/train.parquet (ids repeat per source)."""
    rows = []
    for source, count in (("nq", n_nq), ("hotpotqa", n_hotpot)):
        for i in range(count):
            answers = np.array([f"{source} answer {i}", f"alt {i}"][: 1 + i % 2], dtype=object)
            rows.append({
                "id": f"train_{i}", "question": f"{source} question {i}?", "golden_answers": answers,
                "data_source": source,
                "prompt": [{"role": "user", "content": f"Answer the given question. {i}"}],
                "ability": "fact-reasoning",
                "reward_model": {"style": "rule", "ground_truth": {"target": answers}},
                "extra_info": {"split": "train", "index": i},
            })
    return rows


def _write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# --------------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------------

def test_jsonl_rows_and_defaults(tmp_path):
    path = _write_jsonl(tmp_path / "mini.jsonl", [
        {"id": "q1", "question": "Who?", "golden_answers": ["A", "B"], "data_source": "nq"},
        "",  # blank lines are skipped and do not count as rows
        {"question": "Where?", "golden_answers": "Paris"},
        {"id": 7, "question": "When?", "golden_answers": ["1990"]},
    ])
    assert read_questions(path) == [
        Question("q1", "Who?", ("A", "B"), "nq"),
        Question("mini_1", "Where?", ("Paris",), "mini"),
        Question("7", "When?", ("1990",), "mini"),
    ]


def test_search_r1_parquet_rows(tmp_path):
    path = _write_parquet(tmp_path / "train.parquet", _search_r1_rows(3, 2))
    qs = read_questions(path)
    assert [q.data_source for q in qs] == ["nq"] * 3 + ["hotpotqa"] * 2
    assert qs[1] == Question("train_1", "nq question 1?", ("nq answer 1", "alt 1"), "nq")
    assert all(type(a) is str for q in qs for a in q.golden_answers)


def test_answers_only_under_reward_model_and_defaults_from_stem(tmp_path):
    rows = [{"question": r["question"], "reward_model": r["reward_model"]} for r in _search_r1_rows(2, 0)]
    qs = read_questions(_write_parquet(tmp_path / "test.parquet", rows))
    assert qs == [Question("test_0", "nq question 0?", ("nq answer 0",), "test"),
                  Question("test_1", "nq question 1?", ("nq answer 1", "alt 1"), "test")]


def test_pandas_shaped_row_with_numpy_answers():
    from workflow_r1.data.questions import question_from_row

    row = {"question": "q?", "golden_answers": np.array(["x", "y"], dtype=object),
           "reward_model": {"ground_truth": {"target": np.array(["x", "y"], dtype=object)}}}
    q = question_from_row(row, where="w", default_id="d", default_source="s")
    assert q.golden_answers == ("x", "y") and q.id == "d" and q.data_source == "s"


def test_write_read_round_trip_both_formats(tmp_path):
    qs = bundled_questions()[:5] + [Question("u", "Où est Zürich ?", ("Zürich", "Zurich"), "ünï")]
    for name in ("a.jsonl", "a.parquet"):
        assert read_questions(write_questions(qs, tmp_path / name)) == qs


def test_load_questions_specs(tmp_path):
    bundled = bundled_questions()
    assert len(bundled) == 109 and load_questions("") == bundled == load_questions("bundled")
    a = write_questions(bundled[:2], tmp_path / "a.jsonl")
    b = write_questions(bundled[5:6], tmp_path / "b.parquet")
    assert load_questions(f"{a}, {b}") == bundled[:2] + bundled[5:6]
    with pytest.raises(DataError, match=r"nope\.jsonl: not found$"):
        load_questions(f"{a},{tmp_path / 'nope.jsonl'}")


def _bad_cases(tmp_path):
    """(path, expected message after 'data file PATH') for every kind of bad input."""
    good = {"question": "q?", "golden_answers": ["a"]}
    j = lambda name, *rows: _write_jsonl(tmp_path / name, rows)  # noqa: E731
    (tmp_path / "dir.jsonl").mkdir()
    os.mkfifo(tmp_path / "fifo.jsonl")  # read, it would block forever
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")  # read, it would fill memory
    with open(tmp_path / "huge.jsonl", "wb") as f:  # sparse: no disk used
        f.truncate(questions.MAX_FILE_BYTES + 1)
    (tmp_path / "latin1.jsonl").write_bytes(b'{"question": "q?", "golden_answers": ["a"]}\r\n{"question": "caf\xe9"}\n')
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    body = _write_parquet(tmp_path / "body.parquet", [good] * 50).read_bytes()
    # Magic bytes and footer length intact, metadata zeroed: pyarrow's message ends in a newline.
    (tmp_path / "body.parquet").write_bytes(body[:4] + bytes(len(body) - 12) + body[-8:])
    return [
        (tmp_path / "missing.jsonl", ": not found"),
        (tmp_path / "dir.jsonl", ": not a file"),
        (tmp_path / "fifo.jsonl", ": not a regular file (a pipe, socket or device); copy its contents into a file"),
        (tmp_path / "zero.jsonl", ": not a regular file (a pipe, socket or device); copy its contents into a file"),
        (tmp_path / "huge.jsonl", ": 4.0 GiB, over the 4 GiB read whole into memory; split it into several "
                                  "files (comma-separated in data.train_files)"),
        (j("x.csv", good), ": unknown extension '.csv'; use .jsonl or .parquet (Search-R1 / FlashRAG rows)"),
        (j("empty.jsonl"), ": empty (no question rows)"),
        (j("blank.jsonl", "", "  "), ": empty (no question rows)"),
        (_write_parquet(tmp_path / "empty.parquet", []), ": empty (no question rows)"),
        (j("json.jsonl", good, good, '{"question": "q?", "golden_answers": ["a"'),
         " line 3: invalid JSON (Expecting ',' delimiter at column 42)"),
        (j("list.jsonl", good, ["q?", ["a"]]),
         " line 2: expected a JSON object with 'question' and 'golden_answers', got list"),
        (j("noq.jsonl", good, {"golden_answers": ["a"]}), " line 2: no 'question' (a non-empty string)"),
        (j("emptyq.jsonl", {"question": " ", "golden_answers": ["a"]}),
         " line 1: no 'question' (a non-empty string)"),
        (j("x.jsonl", good, good, good, good, good, good, {"question": "q?"}),
         " line 7: no 'golden_answers' (a list of gold answer strings)"),
        (j("noans.jsonl", {"question": "q?", "golden_answers": []}),
         " line 1: no 'golden_answers' (a list of gold answer strings)"),
        (j("numans.jsonl", {"question": "q?", "golden_answers": [1990]}),
         " line 1: no 'golden_answers' (a list of gold answer strings)"),
        (j("badid.jsonl", {**good, "id": [1]}), " line 1: 'id' must be a string or an integer, got list"),
        (j("badsrc.jsonl", {**good, "data_source": 3}), " line 1: 'data_source' must be a non-empty string"),
        (tmp_path / "latin1.jsonl", " line 2: not UTF-8 text (invalid continuation byte at column 18)"),
        # A lone surrogate escape decodes to a str that nothing can encode (json.dumps writes "\\ud800").
        (j("surrogate.jsonl", good, {"question": "caf\ud800?", "golden_answers": ["a"]}),
         " line 2: 'question' holds an unpaired surrogate escape ('\\ud800' at character 4)"),
        (j("surrogate_ans.jsonl", {"question": "q?", "golden_answers": ["ok", "\udfff"]}),
         " line 1: 'golden_answers' holds an unpaired surrogate escape"),
        (j("deep.jsonl", good, good, "[" * 100_000 + "]" * 100_000), " line 3: JSON nested too deeply"),
        (_write_parquet(tmp_path / "noans.parquet", [{"question": "a?", "golden_answers": ["a"]},
                                                     {"question": "b?", "golden_answers": None}]),
         " row 1: no 'golden_answers' (a list of gold answer strings)"),
        (tmp_path / "junk.parquet", ": not a readable parquet file (ArrowInvalid: "),
        (tmp_path / "body.parquet", ": not a readable parquet file (OSError: "),
    ]


def test_every_bad_input_is_one_line_naming_file_and_line(tmp_path):
    for path, expected in _bad_cases(tmp_path):
        with pytest.raises(DataError) as exc:
            read_questions(path)
        msg = str(exc.value)
        assert "\n" not in msg, msg
        assert msg.startswith(f"data file {path}{expected}"), (msg, expected)


def test_exact_message_from_the_brief(tmp_path):
    rows = [{"question": "q?", "golden_answers": ["a"]}] * 6 + [{"question": "q?"}]
    path = _write_jsonl(tmp_path / "x.jsonl", rows)
    with pytest.raises(DataError) as exc:
        read_questions(path)
    assert str(exc.value) == f"data file {path} line 7: no 'golden_answers' (a list of gold answer strings)"


# --------------------------------------------------------------------------------------------------
# The training mix
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_rows,n,seed", [(1000, 100, 42), (20, 20, 0), (169_615, 10_000, 42), (7, 0, 3)])
def test_sample_positions_equal_pandas(num_rows, n, seed):
    import pandas as pd

    frame = pd.DataFrame({"pos": np.arange(num_rows)})
    expected = frame.sample(n=n, random_state=seed)["pos"].to_numpy()
    np.testing.assert_array_equal(mix.pandas_sample_positions(num_rows, n, seed), expected)


def test_sample_positions_are_pinned():
    # RandomState's legacy stream is frozen (NEP 19); these are its first draws for the paper's seed.
    np.testing.assert_array_equal(mix.pandas_sample_positions(100, 5, 42), [83, 53, 70, 45, 44])
    with pytest.raises(DataError, match="cannot sample 11 rows from 10"):
        mix.pandas_sample_positions(10, 11, 42)


def test_training_mix_equals_pandas_sample_of_the_file(tmp_path):
    import pandas as pd

    train = _write_parquet(tmp_path / "train.parquet", _search_r1_rows(230, 270))
    out = tmp_path / "mix" / "train_mix.jsonl"
    counts = mix.build_training_mix(train, out, n=100, seed=42)
    expected = pd.read_parquet(train).sample(n=100, random_state=42)
    got = read_questions(out)
    assert [(q.data_source, q.id, q.question) for q in got] == list(
        zip(expected["data_source"], expected["id"], expected["question"]))
    assert [q.golden_answers for q in got] == [tuple(a) for a in expected["golden_answers"]]
    assert counts == expected["data_source"].value_counts().sort_index().to_dict()
    assert sum(counts.values()) == 100


def test_mix_cli(tmp_path):
    train = _write_parquet(tmp_path / "train.parquet", _search_r1_rows(30, 40))
    out = tmp_path / "mix.parquet"
    r = subprocess.run([sys.executable, "-m", "workflow_r1.data.mix", f"--train_parquet={train}",
                        f"--out={out}", "--n=20"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    counts = mix.build_training_mix(train, tmp_path / "again.jsonl", n=20)
    assert r.stdout.strip() == f"wrote 20 questions to {out}: " + ", ".join(f"{k} {v}" for k, v in counts.items())
    assert read_questions(out) == read_questions(tmp_path / "again.jsonl")
    r = subprocess.run([sys.executable, "-m", "workflow_r1.data.mix", f"--train_parquet={tmp_path}/no.parquet",
                        f"--out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip() == f"error: data file {tmp_path}/no.parquet: not found"


# --------------------------------------------------------------------------------------------------
# TFDS array_record
# --------------------------------------------------------------------------------------------------

# Fails the subprocess if anything imported TensorFlow (tensorflow_datasets imports it lazily).
_NO_TF = """
import atexit, sys
atexit.register(lambda: "tensorflow" in sys.modules and sys.exit("tensorflow was imported"))
"""


def test_tfds_array_record_round_trip_without_tensorflow(tmp_path):
    import importlib.util

    # The build below runs where TensorFlow is not installed: no requirement may bring it in.
    assert importlib.util.find_spec("tensorflow") is None, "tensorflow is installed; it must not be"
    qs = bundled_questions()[:7] + [Question("u", "Où est Zürich ?", ("Zürich", "Zurich"), "ünï")]
    src = write_questions(qs, tmp_path / "qs.jsonl")
    data_dir = tmp_path / "tfds"
    script = _NO_TF + (
        "from absl import app\n"
        "from workflow_r1.data import tfds_builder\n"
        "tfds_builder.define_flags()\n"
        "app.run(tfds_builder.main)\n")
    tmp = tmp_path / "tmp"  # the build's temporary directory: it must leave nothing there
    tmp.mkdir()
    r = subprocess.run([sys.executable, "-c", script, f"--files={src}", f"--data_dir={data_dir}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "wrote 8 questions" in r.stdout
    assert not list(tmp.iterdir()), "the build left temporary files behind"
    records = list((data_dir / "workflow_r1_questions" / "1.0.0").glob("*.array_record-*"))
    assert len(records) == 1

    read_back = _NO_TF + (
        "import json, tensorflow_datasets as tfds\n"
        "from workflow_r1.data import load_questions\n"
        f"src = tfds.data_source('workflow_r1_questions', data_dir={str(data_dir)!r}, download=False)['train']\n"
        "first = {k: (v.decode() if isinstance(v, bytes) else [a.decode() for a in v]) for k, v in src[7].items()}\n"
        f"rows = [q.to_row() for q in load_questions('tfds:{data_dir}')]\n"
        "print(json.dumps({'first': first, 'rows': rows}))\n")
    r = subprocess.run([sys.executable, "-c", read_back], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["first"] == qs[7].to_row()
    assert out["rows"] == [q.to_row() for q in qs]  # file order kept


def test_tfds_missing_data_dir_is_one_line(tmp_path):
    with pytest.raises(DataError) as exc:
        load_questions(f"tfds:{tmp_path / 'none'}")
    assert "\n" not in str(exc.value) and str(exc.value).startswith(f"tfds data dir {tmp_path / 'none'}: ")


# --------------------------------------------------------------------------------------------------
# The iterator
# --------------------------------------------------------------------------------------------------

QS = [Question(f"q{i}", f"question {i}?", (f"a{i}",), "synthetic") for i in range(23)]


def _ids(batches):
    return [[q.id for q in b] for b in batches]


def _draw(it, k):
    return _ids(it.next() for _ in range(k))


def test_iterator_is_deterministic_and_seeded():
    a, b = QuestionIterator(QS, 4, seed=3), QuestionIterator(QS, 4, seed=3)
    assert _draw(a, 12) == _draw(b, 12)
    assert _draw(QuestionIterator(QS, 4, seed=3), 5) != _draw(QuestionIterator(QS, 4, seed=4), 5)
    assert _draw(QuestionIterator(QS, 4, seed=3, shuffle=False), 6) == [
        [f"q{i}" for i in range(s * 4, s * 4 + 4)] for s in range(5)] + [["q0", "q1", "q2", "q3"]]


def test_host_slices_are_disjoint_and_make_the_global_batch():
    steps, b, hosts = 9, 8, 4
    whole = _draw(QuestionIterator(QS, b, seed=1), steps)
    parts = [_draw(QuestionIterator(QS, b, seed=1, process_index=h, process_count=hosts), steps)
             for h in range(hosts)]
    for s in range(steps):
        assert all(len(p[s]) == b // hosts for p in parts)
        assert sum((p[s] for p in parts), []) == whole[s]  # host h holds rows h*b/P..(h+1)*b/P
        assert len(set(sum((p[s] for p in parts), []))) == b
    with pytest.raises(ValueError, match="not a multiple of process_count 3"):
        QuestionIterator(QS, 8, seed=0, process_count=3)


@pytest.mark.parametrize("stop", [3, 5, 7, 11])  # mid-epoch and at an epoch boundary (5 steps/epoch)
def test_resume_draws_what_an_uninterrupted_run_draws(stop):
    uninterrupted = _draw(QuestionIterator(QS, 4, seed=9), 17)
    first = QuestionIterator(QS, 4, seed=9)
    head = _draw(first, stop)
    state = json.loads(json.dumps(first.get_state()))
    resumed = QuestionIterator(QS, 4, seed=9)
    resumed.set_state(state)
    assert (resumed.step, resumed.epoch) == (stop, stop // 5)
    assert head + _draw(resumed, 17 - stop) == uninterrupted
    # A resumed run on another number of hosts keeps the global order.
    halves = [QuestionIterator(QS, 4, seed=9, process_index=h, process_count=2) for h in range(2)]
    for h in halves:
        h.set_state(state)
    assert [x + y for x, y in zip(_draw(halves[0], 3), _draw(halves[1], 3))] == uninterrupted[stop:stop + 3]


def test_set_state_refuses_other_data_or_settings():
    state = QuestionIterator(QS, 4, seed=9).get_state()
    for other in (QuestionIterator(QS[:-1], 4, seed=9), QuestionIterator(QS, 2, seed=9),
                  QuestionIterator(QS, 4, seed=8), QuestionIterator(QS, 4, seed=9, shuffle=False),
                  QuestionIterator(QS[1:] + QS[:1], 4, seed=9)):
        with pytest.raises(ValueError, match=r"^QuestionIterator.set_state: the state was saved with "):
            other.set_state(state)


def test_epochs_reshuffle_with_seed_plus_epoch_and_drop_the_remainder():
    it = QuestionIterator(QS, 4, seed=5)  # 23 questions: 5 full batches, 3 dropped each epoch
    assert it.steps_per_epoch == 5
    epochs = [sum(_draw(it, 5), []) for _ in range(3)]
    assert it.epoch == 3 and it.step == 15
    for e, order in enumerate(epochs):
        assert len(order) == len(set(order)) == 20  # no question twice within an epoch
        assert order == sum(_draw(QuestionIterator(QS, 4, seed=5 + e), 5), [])
    assert epochs[0] != epochs[1] != epochs[2]
    finite = QuestionIterator(QS, 4, seed=5, num_epochs=2)
    assert len(list(itertools.islice(finite, 100))) == 10 and finite.epoch == 2
    with pytest.raises(StopIteration):
        finite.next()


def test_iterator_reads_a_tfds_sequence_like_a_list():
    class Lazy:  # any random-access Sequence works (e.g. tfds_builder.TfdsQuestions)
        def __len__(self):
            return len(QS)

        def __getitem__(self, i):
            return QS[i]

    assert _draw(QuestionIterator(Lazy(), 4, seed=2), 7) == _draw(QuestionIterator(QS, 4, seed=2), 7)


# --------------------------------------------------------------------------------------------------
# DataConfig and the split
# --------------------------------------------------------------------------------------------------

def test_split_holds_out_eval_deterministically():
    qs = bundled_questions()
    train, evaluation = split_train_eval(qs, DataConfig(), seed=0)
    assert (len(train), len(evaluation)) == (93, 16)
    assert not {q.id for q in train} & {q.id for q in evaluation}
    assert sorted(q.id for q in train + evaluation) == sorted(q.id for q in qs)
    assert [q.id for q in train] == sorted(q.id for q in train)  # file order kept
    assert (train, evaluation) == split_train_eval(qs, DataConfig(), seed=0) == load_data(DataConfig(), 0)
    assert split_train_eval(qs, DataConfig(), seed=1)[1] != evaluation
    capped, evaluation2 = split_train_eval(qs, DataConfig(max_questions=10), seed=0)
    assert evaluation2 == evaluation and len(capped) == 10 and set(capped) <= set(train)
    assert split_train_eval(qs, DataConfig(eval_holdout=0), seed=0) == (qs, [])
    with pytest.raises(DataError, match="^data.eval_holdout=109 leaves no training question out of 109;"):
        split_train_eval(qs, DataConfig(eval_holdout=109), seed=0)


def test_split_with_eval_files(tmp_path):
    qs = bundled_questions()
    path = write_questions(qs[:3], tmp_path / "dev.jsonl")
    train, evaluation = split_train_eval(qs, DataConfig(eval_files=str(path)), seed=0)
    assert train == qs and evaluation == qs[:3]


def test_data_config_is_a_config_section():
    section = configlib.section(DataConfig, eval_holdout=4)
    section.train_files = "a.jsonl,b.parquet"
    cfg = configlib.to_dataclass(DataConfig, section, "data")
    assert cfg == DataConfig(train_files="a.jsonl,b.parquet", eval_holdout=4)
    section.max_questions = -1
    with pytest.raises(configlib.ConfigError, match="max_questions -1 must be >= 0"):
        configlib.to_dataclass(DataConfig, section, "data")


def test_a_data_section_without_evaluation_questions_has_a_warning_naming_the_keys():
    sys.path.insert(0, str(ROOT))
    from configs import base

    def data(preset, **changes):
        section = configlib.to_dataclass(DataConfig, base.get_config(preset).data, "data")
        return dataclasses.replace(section, **changes)

    warning = data("paper").no_evaluation_warning()  # the paper preset's defaults: nothing held out, no files
    assert warning.startswith("warning: this run evaluates nothing") and "\n" not in warning
    assert "--config.data.eval_files=" in warning and "--config.data.eval_holdout=N" in warning
    assert data("paper", eval_files="test.jsonl").no_evaluation_warning() is None
    assert data("paper", eval_holdout=8).no_evaluation_warning() is None
    assert data("local").no_evaluation_warning() is None and data("tiny").no_evaluation_warning() is None
