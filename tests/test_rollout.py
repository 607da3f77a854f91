"""The rollout engine: token layout equals the chat template, masks, caps, budgets, executor faults.

A scripted policy plays the sampler (each row's turns are fixed texts, tokenized canonically and
ended with the end-of-turn token), so every expected token comes from the tokenizer's own
`apply_chat_template` of the finished conversation, not from the engine. The executor is the real
HTTP service with the deterministic fake LLM.
"""
from __future__ import annotations

import numpy as np
import pytest

from workflow_r1.data.questions import Question
from workflow_r1.task import protocol
from workflow_r1.task.config import EnvConfig
from workflow_r1.task.operators import WARNING_TEXT
from workflow_r1.executor import ExecutorClient, FakeBackend, start_in_thread
from workflow_r1.model import tokenizer as tokenizer_lib
from workflow_r1.rollout import RolloutConfig, RolloutEngine, episode_metrics, pack, padded_length
from workflow_r1.rollout import scripted
from workflow_r1.rollout.episode import Episode, Turn
from workflow_r1.envs.workflow import WorkflowEnvironment

TOOL = "<think>I should ask.</think>\n<tool>AnswerGenerate: What is the capital of France?</tool>"
ANSWER = "<think>The operator said Paris.</think>\n<answer>Paris</answer>"


class ScriptedPolicy(scripted.ScriptedPolicy):
    """Plays `scripts[row][turn]` (text, its last one repeated) for each row, ended by the end-of-turn
    token; records what the engine asked for the assertions.

    lp: the log-prob of every sampled token, or `lp(row, turn, n) -> [n]` for per-token values.
    Recorded (besides the base class's calls and turn_seeds): turns (row -> turns opened), limits
    ((row, turn) -> the most tokens any call offered that turn), sampled (row -> the log-prob arrays
    of its turns, in turn order).
    """

    def __init__(self, tokenizer, scripts, lp=-0.25):
        super().__init__()
        self.tok, self.scripts, self.lp = tokenizer, scripts, lp
        self.eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        self.turns, self.limits, self.sampled = {}, {}, {}

    def turn(self, row, k, sequence):
        self.turns[row] = k + 1
        script = self.scripts[row]
        return self.tok.encode(script[min(k, len(script) - 1)], add_special_tokens=False) + [self.eos]

    def logprobs(self, row, k, ids):
        lp = self.lp(row, k, len(ids)) if callable(self.lp) else np.full(len(ids), self.lp)
        self.sampled.setdefault(row, []).append(np.asarray(lp, np.float32))
        return lp

    def generate_paged(self, pages, tables, sequences, cached, max_new_tokens, **kw):
        out = super().generate_paged(pages, tables, sequences, cached, max_new_tokens, **kw)
        for row, offset, limit in zip(kw["row_ids"], kw["step_offset"], max_new_tokens):
            key = (row, self.turns[row] - 1)
            self.limits[key] = max(self.limits.get(key, 0), offset + limit)
        return out


@pytest.fixture(scope="module")
def executor():
    handle = start_in_thread(FakeBackend(answers={"capital of france": "Paris"}))
    client = ExecutorClient(handle.url, timeout_s=30)
    yield client
    client.close()
    handle.stop()


def _q(text="What is the capital of France?", gold=("Paris",), i=0):
    return Question(id=f"q{i}", question=text, golden_answers=tuple(gold), data_source="test")


def _engine(tokenizer, scripts, executor, env=None, lp=-0.25, **cfg):
    policy = ScriptedPolicy(tokenizer, scripts, lp)
    rc = RolloutConfig(**{"prompts_per_step": 1, "n": 1, "max_prompt_tokens": 8192, "max_response_tokens": 4096,
                          **cfg})
    return RolloutEngine(policy, rc, WorkflowEnvironment.of(tokenizer, executor.execute_many_sync, env or EnvConfig(), rc)), policy


def _check_layout(tokenizer, ep):
    """Tokens == the chat template of the conversation; masks and segments as the turns say."""
    text = tokenizer.apply_chat_template(ep.messages, tokenize=False)
    expected = tokenizer.encode(text, add_special_tokens=False)
    # The template ends the last assistant message with "<|im_end|>\n"; nothing generates the "\n".
    assert expected[-1] == tokenizer.encode("\n", add_special_tokens=False)[0]
    assert ep.prompt_ids + ep.response_ids == expected[:-1]
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    mask, seg = np.asarray(ep.loss_mask), np.asarray(ep.segment_ids)
    pos = 0
    for k, turn in enumerate(ep.turns):
        n = len(tokenizer.encode(turn.text, add_special_tokens=False)) + 1
        assert mask[pos:pos + n].tolist() == [1] * n and seg[pos:pos + n].tolist() == [k] * n
        assert ep.response_ids[pos + n - 1] == eos  # the sampled end-of-turn token carries mask 1
        pos += n
        if turn.observation is not None and pos < len(mask):
            # The observation: everything up to the next turn, all mask 0 / segment -1, and it is
            # the tool message the conversation records.
            nxt = pos + int(np.argmax(mask[pos:] == 1)) if (mask[pos:] == 1).any() else len(mask)
            assert mask[pos:nxt].tolist() == [0] * (nxt - pos) and (seg[pos:nxt] == -1).all()
            assert protocol.format_observation(turn.observation) in tokenizer.decode(ep.response_ids[pos:nxt])
            pos = nxt
    assert pos == len(mask)
    assert (np.asarray(ep.logprobs)[mask == 0] == 0).all() and (np.asarray(ep.logprobs)[mask == 1] == -0.25).all()


def test_layout_masks_and_reward_byte_tokenizer(executor):
    tok = tokenizer_lib.byte_level()
    scripts = [[TOOL, ANSWER], ["<think>hm</think><tool>Nope: x</tool>", "no tags at all", ANSWER]]
    engine, policy = _engine(tok, scripts, executor, n=1)
    episodes, stats = engine.run([_q(i=0), _q(i=1)], n=1, seed=3)
    a, b = episodes
    _check_layout(tok, a)
    _check_layout(tok, b)
    assert a.finish_reason == "answer" and a.num_turns == 2 and a.operator_rounds == 1
    assert "AnswerGenerate answer: Paris" in a.turns[0].observation and a.turns[0].error_kind is None
    assert a.reward == 1.0 and a.reward_format == 0.0  # think, tool, observation, think, answer
    assert b.turns[0].observation == protocol.unknown_operator_text("Nope", engine.environment.env.pool)
    assert b.turns[1].observation == WARNING_TEXT and b.operator_rounds == 2
    # An episode that finished is not generated again: row 0 was asked for its 2 turns, row 1 for 3.
    assert policy.turns == {0: 2, 1: 3}
    assert stats.rounds == len(policy.calls) and stats.generated_tokens == sum(x.generated_tokens for x in episodes)


def test_a_turn_stops_at_its_action_and_is_closed_as_the_template_closes_it(executor):
    """rollout.stop_at_action: the turn ends with the '>' that completes its tool call (the text the
    policy would have written after it is never generated), and the observation that follows starts
    with the end-of-turn token, so the tokens are still the chat template of the conversation."""
    tok = tokenizer_lib.byte_level()
    scripts = [[TOOL + " you then receive: <info>Rome</info> <answer>Rome</answer>", ANSWER + " more"]]
    engine, _ = _engine(tok, scripts, executor, max_tokens_per_step=16, stop_at_action=True)
    (ep,), _ = engine.run([_q()], n=1)
    assert [t.text for t in ep.turns] == [TOOL, ANSWER]
    # The template closes each assistant message with the end-of-turn token and a newline. The
    # stopped turns never sampled it: the one an observation follows gets it there (mask 0), the
    # last one has none.
    expected = tok.encode(tok.apply_chat_template(ep.messages, tokenize=False), add_special_tokens=False)
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    assert ep.prompt_ids + ep.response_ids == expected[:-2] and expected[-2] == eos
    n = len(tok.encode(TOOL, add_special_tokens=False))
    assert ep.loss_mask[:n] == [1] * n and (ep.response_ids[n], ep.loss_mask[n]) == (eos, 0)
    assert sum(ep.loss_mask) == n + len(tok.encode(ANSWER, add_special_tokens=False))
    assert ep.reward == 1.0 and ep.reward_format == 0.0
    # Off (the release's rule), the same scripts run to their end-of-turn tokens.
    engine, _ = _engine(tok, scripts, executor, max_tokens_per_step=16)
    (ep,), _ = engine.run([_q()], n=1)
    assert ep.turns[0].text == scripts[0][0] and ep.reward == 0.5 and ep.reward_format == -0.5
    with pytest.raises(ValueError, match="max_tokens_per_step"):
        RolloutConfig(stop_at_action=True)


@pytest.mark.real_model
def test_layout_equals_qwen_chat_template(qwen05b_dir, executor):
    tok = tokenizer_lib.load(qwen05b_dir)
    scripts = [[TOOL, "<think>Check it.</think><tool>Review: <question>Capital of France?</question>"
                "<solution>Paris</solution></tool>", ANSWER]]
    engine, _ = _engine(tok, scripts, executor)
    (ep,), _ = engine.run([_q()], n=1)
    _check_layout(tok, ep)
    assert ep.num_turns == 3 and ep.reward == 1.0


def test_call_cap_and_turn_cap(executor):
    tok = tokenizer_lib.byte_level()
    big = {"max_response_tokens": 200_000}  # byte tokens: 20 observations of ~2 kB each must fit
    engine, policy = _engine(tok, [[TOOL]], executor, **big)
    (ep,), _ = engine.run([_q()], n=1)
    # 20 observation rounds, then the 21st turn ends the episode (both caps meet there).
    assert ep.operator_rounds == 20 and ep.num_turns == 21 and ep.finish_reason in ("turn_cap", "call_cap")
    engine, _ = _engine(tok, [[TOOL]], executor, max_assistant_turns=30, **big)
    (ep,), _ = engine.run([_q()], n=1)
    assert ep.operator_rounds == 20 and ep.num_turns == 21 and ep.finish_reason == "call_cap"
    assert ep.reward == -1.5  # never answered: no answer, invalid format
    engine, _ = _engine(tok, [[TOOL]], executor, max_assistant_turns=5, **big)
    (ep,), _ = engine.run([_q()], n=1)
    assert ep.num_turns == 5 and ep.operator_rounds == 4 and ep.finish_reason == "turn_cap"


def test_warning_answer_quirk_is_counted(executor):
    tok = tokenizer_lib.byte_level()
    engine, _ = _engine(tok, [["no tags at all"]], executor, max_assistant_turns=3)
    (ep,), _ = engine.run([_q()], n=1)
    # Never answered, but WarningOp's "<answer>...</answer>" is scored: -0.5, not -1.5 (kept, and counted).
    assert ep.finish_reason == "turn_cap" and ep.reward == -0.5 and ep.answer_source == "warning"
    assert episode_metrics([ep])["answer_from_warning"] == 1.0 and ep.summary()["answer_source"] == "warning"
    engine, _ = _engine(tok, [["no tags at all", ANSWER]], executor)
    (ep,), _ = engine.run([_q()], n=1)
    assert ep.reward == 0.5 and ep.answer_source == "policy"


def test_the_prompt_sets_executor_prompts_travel_with_every_call(tmp_path, executor):
    (tmp_path / "AnswerGenerate.template.txt").write_text("PIRATE VOICE please: {input} <think> <answer>")
    tok = tokenizer_lib.byte_level()
    engine, _ = _engine(tok, [[TOOL, ANSWER]], executor, env=EnvConfig(prompt_set=str(tmp_path)))
    (ep,), _ = engine.run([_q()], n=1)
    # The fake executor LLM quotes its prompt: the server's default (faithful) set was overridden.
    assert "PIRATE VOICE please: What is the capital of France?" in ep.turns[0].observation


def test_executor_failure_is_an_observation():
    tok = tokenizer_lib.byte_level()
    dead = ExecutorClient("http://127.0.0.1:9", timeout_s=5)  # nothing listens on the discard port
    policy = ScriptedPolicy(tok, [[TOOL, ANSWER]])
    rc = RolloutConfig(max_prompt_tokens=8192)
    engine = RolloutEngine(policy, rc, WorkflowEnvironment.of(tok, dead.execute_many_sync, EnvConfig(), rc))
    (ep,), _ = engine.run([_q()], n=1)
    dead.close()
    assert ep.turns[0].error_kind == "client_connection" and "cannot reach the executor" in ep.turns[0].observation
    assert ep.finish_reason == "answer" and ep.num_turns == 2


def test_budget_ends_instead_of_cutting_an_observation(executor):
    tok = tokenizer_lib.byte_level()
    turn_len = len(tok.encode(TOOL, add_special_tokens=False)) + 1
    # Room for the first turn but not for its observation: the episode ends after the turn.
    engine, policy = _engine(tok, [[TOOL, ANSWER]], executor, max_response_tokens=turn_len + 40)
    (ep,), _ = engine.run([_q()], n=1)
    assert ep.finish_reason == "budget" and ep.response_length == turn_len and ep.operator_rounds == 0
    assert ep.turns[0].observation is not None and policy.turns == {0: 1}
    # A turn longer than what is left is cut at the budget (no end-of-turn token) and ends the episode.
    engine, policy = _engine(tok, [[TOOL, ANSWER]], executor, max_response_tokens=10)
    (ep,), _ = engine.run([_q()], n=1)
    assert ep.finish_reason == "budget" and ep.response_length == 10 and policy.limits == {(0, 0): 10}


def test_groups_are_adjacent_and_pack_into_the_batch(executor):
    tok = tokenizer_lib.byte_level()
    scripts = [[ANSWER], [TOOL, ANSWER], ["<answer>Lyon</answer>"]] * 2

    def lp(row, turn, n):  # a distinct log-prob for every sampled token of the rollout
        return -(1000 * row + 100 * turn + np.arange(1, n + 1)) / 8192

    engine, policy = _engine(tok, scripts, executor, lp=lp)
    episodes, _ = engine.run([_q(i=0), _q("Capital of Italy?", ("Rome",), i=1)], n=3)
    assert [(e.group, e.sample) for e in episodes] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [e.question.id for e in episodes] == ["q0"] * 3 + ["q1"] * 3
    t = padded_length(episodes, 64)
    assert t % 64 == 0 and t >= max(len(e.prompt_ids) + e.response_length for e in episodes)
    adv = np.arange(6, dtype=np.float32)
    b = pack(episodes, adv, pad_id=tok.pad_token_id, length=t)
    for i, e in enumerate(episodes):
        p, r = len(e.prompt_ids), e.response_length
        assert b.tokens[i, :p + r].tolist() == e.prompt_ids + e.response_ids
        assert (b.tokens[i, p + r:] == tok.pad_token_id).all() and b.input_mask[i].sum() == p + r
        assert b.loss_mask[i, p:p + r].tolist() == e.loss_mask and b.loss_mask[i, :p].sum() == 0
        assert b.segment_ids[i, p:p + r].tolist() == e.segment_ids
        assert b.positions[i, :p + r].tolist() == list(range(p + r))
        # The sampler's log-probs: at the sampled tokens exactly what the policy returned for this
        # row (turn after turn), 0 on the prompt, the observations and the padding.
        slp = b.sampler_logprobs[i]
        sampled = np.flatnonzero(b.loss_mask[i])
        np.testing.assert_array_equal(slp[sampled], np.concatenate(policy.sampled[i]))
        assert (np.delete(slp, sampled) == 0).all() and len(sampled) == e.generated_tokens
    assert b.advantages.tolist() == adv.tolist()


def test_overlong_prompts_are_skipped(executor):
    tok = tokenizer_lib.byte_level()
    engine, _ = _engine(tok, [[ANSWER]], executor, max_prompt_tokens=200)
    episodes, stats = engine.run([_q()], n=2)
    assert episodes == [] and stats.skipped_questions == 1


def test_env_prompt_set_directory_and_release_newline(tmp_path, executor):
    (tmp_path / "policy.txt").write_text("Ops:\n{operators}\nAt most {max_calls} calls.\nQ: {question}\n")
    (tmp_path / "system.txt").write_text("Be brief.\n")
    env = EnvConfig(prompt_set=str(tmp_path), max_operator_calls=5)
    msgs = env.messages("  Capital of France? ")
    assert msgs[0] == {"role": "system", "content": "Be brief."}
    assert msgs[1]["content"].startswith("Ops:\n1. AnswerGenerate") and msgs[1]["content"].endswith(
        "At most 5 calls.\nQ: Capital of France?")
    # template_newline=False: the release's stream, no "\n" between the turn's <|im_end|> and the observation.
    tok = tokenizer_lib.byte_level()
    engine, _ = _engine(tok, [[TOOL, ANSWER]], executor, template_newline=False)
    (ep,), _ = engine.run([_q()], n=1)
    first_obs = ep.loss_mask.index(0)
    assert ep.response_ids[first_obs] == tok.convert_tokens_to_ids("<|im_start|>")
    engine, _ = _engine(tok, [[TOOL, ANSWER]], executor)
    (ep,), _ = engine.run([_q()], n=1)
    assert tok.decode([ep.response_ids[ep.loss_mask.index(0)]]) == "\n"


def test_max_turn_tokens_caps_every_turn(executor):
    """rollout.max_turn_tokens: each turn is asked for at most the cap (or what is left of the
    response budget, when that is less), and a turn the cap cuts is recorded at exactly the cap."""
    tok = tokenizer_lib.byte_level()
    cap, short = 24, "<answer>Paris</answer>"
    tool_ids = tok.encode(TOOL, add_special_tokens=False)
    assert len(tok.encode(short, add_special_tokens=False)) + 1 <= cap < len(tool_ids)
    engine, policy = _engine(tok, [[TOOL, short]], executor, max_turn_tokens=cap)
    (ep,), _ = engine.run([_q()], n=1)
    assert policy.limits == {(0, 0): cap, (0, 1): cap}
    # Turn 0 is cut at the cap (no end-of-turn token: a malformed turn, answered by WarningOp);
    # turn 1 fits and answers.
    assert ep.segment_ids.count(0) == cap and ep.response_ids[:cap] == tool_ids[:cap]
    assert ep.turns[0].action == "warning" and ep.turns[0].observation == WARNING_TEXT
    assert ep.finish_reason == "answer" and ep.segment_ids.count(1) == len(short) + 1
    observation = ep.response_length - cap - (len(short) + 1)
    # A budget that leaves 10 tokens after the first turn and its observation: the budget binds.
    engine, policy = _engine(tok, [[TOOL, short]], executor, max_turn_tokens=cap,
                             max_response_tokens=cap + observation + 10)
    (ep,), _ = engine.run([_q()], n=1)
    assert policy.limits == {(0, 0): cap, (0, 1): 10}
    assert ep.finish_reason == "budget" and ep.segment_ids.count(1) == 10
    # Rows of one call get their own limits: a turn that fits is not cut.
    engine, policy = _engine(tok, [[short], [TOOL, short]], executor, max_turn_tokens=cap)
    a, b = engine.run([_q(i=0), _q(i=1)], n=1)[0]
    assert policy.limits[(0, 0)] == policy.limits[(1, 0)] == cap and a.response_length == len(short) + 1
    assert a.finish_reason == "answer" and b.segment_ids.count(0) == cap


def test_every_turn_samples_with_its_own_seed(executor):
    """Turn t of every episode is sampled with one seed (its own sampling keys, the row id telling
    episodes apart), a seed that follows from the run's seed and t alone and is a valid PRNGKey seed."""
    tok = tokenizer_lib.byte_level()

    def seeds(seed):
        engine, policy = _engine(tok, [[TOOL, TOOL, ANSWER], [TOOL, ANSWER]], executor)
        engine.run([_q(i=0), _q(i=1)], n=1, seed=seed)
        assert sorted(policy.turn_seeds) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
        per_turn = [{s for (_, k), s in policy.turn_seeds.items() if k == t} for t in range(3)]
        assert all(len(s) == 1 for s in per_turn)  # both episodes' turn t: one seed
        return [s.pop() for s in per_turn]

    s3 = seeds(3)
    assert len(set(s3)) == 3  # three turns, three different seeds
    assert seeds(3) == s3  # reproducible from the run's seed
    assert not set(seeds(4)) & set(s3)  # another step's rollout draws other keys
    assert all(0 <= s < 2 ** 31 for s in s3 + seeds(2 ** 40))


def test_pack_and_padded_length_at_their_edges():
    """Hand-built episodes: a row exactly as long as the batch, the rounding at a multiple, the
    multi-host floor, and segment -1 / mask 0 / log-prob 0 everywhere but the sampled turns."""
    def episode(prompt_len, turns):
        e = Episode(question=_q(), group=0, sample=0, messages=[], prompt_ids=list(range(1, prompt_len + 1)))
        for k, n in enumerate(turns):
            if k:
                e.add_observation([7] * 3, "<info>x</info>")
            e.add_turn([40 + k] * n, np.full(n, -0.5 - k, np.float32), Turn(text="t", action="warning", operator=None))
        return e

    a, b = episode(5, [4, 2]), episode(50, [14])  # 5 + 4 + 3 + 2 = 14 and 50 + 14 = 64 tokens
    assert padded_length([a, b], 64) == 64 and padded_length([a], 7) == 14 and padded_length([a], 8) == 16
    assert padded_length([a, b], 64, at_least=65) == 128 and padded_length([a, b], 64, at_least=64) == 64
    batch = pack([a, b], np.array([1.0, -1.0], np.float32), pad_id=0, length=64)
    assert batch.input_mask[1].tolist() == [1] * 64 and batch.input_mask[0].tolist() == [1] * 14 + [0] * 50
    seg = [-1] * 5 + [0] * 4 + [-1] * 3 + [1] * 2 + [-1] * 50
    assert batch.segment_ids[0].tolist() == seg and batch.segment_ids[1].tolist() == [-1] * 50 + [0] * 14
    assert batch.loss_mask[0].tolist() == [int(s >= 0) for s in seg]
    np.testing.assert_array_equal(batch.sampler_logprobs[0],
                                  [0] * 5 + [-0.5] * 4 + [0] * 3 + [-1.5] * 2 + [0] * 50)
    assert batch.tokens[0].tolist() == [1, 2, 3, 4, 5] + [40] * 4 + [7] * 3 + [41] * 2 + [0] * 50
    with pytest.raises(ValueError, match="episode 1 has 64 tokens; the batch length is 63"):
        pack([a, b], np.zeros(2, np.float32), pad_id=0, length=63)
