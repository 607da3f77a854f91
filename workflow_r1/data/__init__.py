"""Questions for training and evaluation: Search-R1 / FlashRAG files, the paper's training mix, a
TFDS array_record build, and the trainer's deterministic, checkpointable batch iterator.

    train, evaluation = load_data(DataConfig(train_files="mix.jsonl"), seed=0)
    batches = QuestionIterator(train, batch_size=512, seed=0, process_index=jax.process_index(),
                               process_count=jax.process_count())
    questions = batches.next()          # this host's slice of the global batch
    state = batches.get_state()         # JSON; batches.set_state(state) resumes exactly

Modules: questions (Question, readers, DataError), mix (the 10k NQ + HotpotQA sample),
tfds_builder (the array_record build) and tfds_source (its read-back; both import
tensorflow_datasets), iterator (QuestionIterator), config (DataConfig, load_questions,
split_train_eval, load_data).
"""
from workflow_r1.data.config import DataConfig, load_data, load_questions, split_train_eval
from workflow_r1.data.iterator import QuestionIterator
from workflow_r1.data.questions import (DataError, Question, bundled_questions, read_questions, source_counts,
                                        write_questions)

__all__ = [
    "DataConfig", "DataError", "Question", "QuestionIterator", "bundled_questions", "load_data",
    "load_questions", "read_questions", "source_counts", "split_train_eval", "write_questions",
]
