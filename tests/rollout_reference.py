"""What the rollout engine's tests share: `EchoEnv`, the tiny model's samplers, and the reference the
engine's episodes are checked against.

The policy is the `tiny-chat` preset's random model over the byte-level tokenizer. A random model
never writes a well-formed tool call, so the episodes run in `EchoEnv`, an environment whose
decisions depend only on the episode's own tokens: a turn whose first token is a multiple of 3 gets
a reply, any other turn an operator call (echoed back after a latency the test chooses), and the
fourth turn ends the episode. Many end-of-turn ids make turns of different lengths, so episodes
finish at different times and the engine really refills and overlaps.

`reference` rolls out one episode at a time, each in its own one-row sampler session, turn after
turn with the sampler's plain multi-turn calls (`start`, `generate_from`, `append`): no pages, no
prefix cache, no batch-mates, no concurrency. Its episodes are what the engine must give whatever
its schedule; both follow the same episode rules (rollout/rules.py), which have tests of their own.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from workflow_r1.data.questions import Question
from workflow_r1.task import reward
from workflow_r1.model import qwen2
from workflow_r1.model import tokenizer as tokenizer_lib
from workflow_r1.model.config import get_preset
from workflow_r1.rollout import RolloutConfig, RolloutEngine, rules
from workflow_r1.rollout.environment import Opening, Step
from workflow_r1.rollout.episode import FINISH_BUDGET, Episode, Turn
from workflow_r1.sampler import Sampler

EOS_IDS = tuple(range(100, 120))  # ~6% of a random model's draws end the turn
CFG = dict(prompts_per_step=2, n=4, max_prompt_tokens=64, max_response_tokens=120, max_turn_tokens=24,
           max_assistant_turns=4)


class EchoEnv:
    """See the module docstring. `latency(call) -> seconds`; `fail`: calls whose content starts
    with it raise inside `execute`; `hook(episode, turn_ids)`: called by every `step`."""

    def __init__(self, tok, latency=lambda call: 0.0, fail=None, hook=None):
        self.tok, self.latency, self.fail, self.hook = tok, latency, fail, hook

    def open(self, question):
        return Opening([{"role": "user", "content": question.question}],
                       self.tok.encode(question.question, add_special_tokens=False))

    def step(self, episode, turn_ids):
        if self.hook is not None:
            self.hook(episode, turn_ids)
        text = self.tok.decode(list(turn_ids))
        if episode.num_turns + 1 >= 4:
            return Step(Turn(text, "answer", None), finish="answer")
        if turn_ids[0] % 3 == 0:
            return Step(Turn(text, "warning", "WarningOp"), reply=f"warn {len(turn_ids)}")
        return Step(Turn(text, "tool", "Echo"), call=("Echo", f"{episode.group}.{episode.sample}:{turn_ids[0]}"))

    def execute(self, calls):
        out = []
        for call in calls:
            time.sleep(self.latency(call))
            if self.fail is not None and call[1].startswith(self.fail):
                raise RuntimeError("the operator fell over")
            out.append((f"echo {call[1]}", None))
        return out

    def observe(self, episode, text):
        return self.tok.encode(text, add_special_tokens=False), text

    def score(self, episode):
        return reward.RewardBreakdown(0.0, 0.0, 0.0)


@pytest.fixture(scope="module")
def tok():
    return tokenizer_lib.byte_level()


@pytest.fixture(scope="module")
def sampler(tok):
    model = qwen2.create(get_preset("tiny-chat"), seed=0)
    return Sampler(model, tok, cache_size=RolloutConfig(**CFG).cache_size, eos_ids=EOS_IDS)


@pytest.fixture(scope="module", params=["fused_cpu", "model", "model_scanned"])
def any_sampler(request, sampler, tok):
    """The fixture's sampler (the fused CPU path), one on the NNX model's own forward, and one on the
    model with scanned layers (its stacked [L, B, ...] cache keeps rows on axis 1)."""
    if request.param == "fused_cpu":
        return sampler
    model = qwen2.create(get_preset("tiny-chat"), seed=0, scan_layers=request.param == "model_scanned")
    return Sampler(model, tok, cache_size=sampler.cache_size, eos_ids=EOS_IDS, impl="model")


QUESTIONS = [Question(id=f"q{i}", question=q, golden_answers=("x",), data_source="test")
             for i, q in enumerate(["What is the capital of France?", "Who wrote Hamlet?"])]


def _run(sampler, env, *, greedy=False, seed=5, questions=QUESTIONS, **cfg):
    engine = RolloutEngine(sampler, RolloutConfig(**{**CFG, **cfg}), env)
    return engine.run(questions, seed=seed, greedy=greedy)


# Two engines compute a row in batches of different shapes, so its logits agree only to float
# rounding; where the two best tokens tie to that precision, greedy decoding may take either. An
# episode may part from its reference at such a token only: a policy token whose log-prob is the same
# under both engines within NEAR_TIE (both picks were the maximum). Up to it the episodes are equal;
# after it they are different episodes. A sampled draw that parts is refused (its two tokens' log-probs
# differ), as is a parting anywhere else: at an observation, the prompt, or a token of a real gap.
NEAR_TIE = 1e-4


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.group, x.sample) == (y.group, y.sample) and x.prompt_ids == y.prompt_ids
        i = next((k for k, (s, t) in enumerate(zip(x.response_ids, y.response_ids)) if s != t), None)
        if i is None:
            assert (x.finish_reason, x.response_ids) == (y.finish_reason, y.response_ids)
            assert x.loss_mask == y.loss_mask and x.segment_ids == y.segment_ids
            assert [t.observation for t in x.turns] == [t.observation for t in y.turns]
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)
            continue
        gap = abs(x.logprobs[i] - y.logprobs[i])
        assert x.loss_mask[i] == y.loss_mask[i] == 1 and gap < NEAR_TIE, (
            f"episode {x.group}/{x.sample} parts at response token {i} ({x.response_ids[i]} != {y.response_ids[i]}, "
            f"loss mask {x.loss_mask[i]}/{y.loss_mask[i]}, log-probs {x.logprobs[i]:.6f} / {y.logprobs[i]:.6f}): "
            "not a near-tie of two policy tokens")
        assert x.loss_mask[:i] == y.loss_mask[:i] and x.segment_ids[:i] == y.segment_ids[:i]
        np.testing.assert_allclose(x.logprobs[:i], y.logprobs[:i], atol=1e-4)


def reference(sampler, env, *, greedy=False, seed=5, questions=QUESTIONS, row_offset=0, **cfg):
    """The episodes of `_run(sampler, env, ...)`, computed one at a time (see the module docstring)."""
    cfg = RolloutConfig(**{**CFG, **cfg})
    episodes = []
    for qi, q in enumerate(questions):
        opening = env.open(q)
        for j in range(cfg.n):
            ep = Episode(question=q, group=row_offset // cfg.n + qi, sample=j,
                         messages=[dict(m) for m in opening.messages], prompt_ids=list(opening.prompt_ids))
            row_id = row_offset + len(episodes)
            session = sampler.start([ep.prompt_ids])
            while True:
                limit = rules.turn_limit(cfg, ep)
                if limit <= 0:
                    ep.finish_reason = FINISH_BUDGET
                    break
                out = sampler.generate_from(session, [limit], rows=[0], temperature=0.0 if greedy else cfg.temperature,
                                            top_p=cfg.top_p, top_k=cfg.top_k,
                                            seed=[rules.turn_seed(seed, ep.num_turns)], row_ids=[row_id])
                kind, what = rules.end_turn(cfg, env, ep, out.tokens[0], out.logprobs[0])
                if kind == "finish":
                    break
                text, error = env.execute([what])[0] if kind == "call" else (what, None)
                ids = rules.observe(cfg, env, ep, text, error)
                if ids is None:
                    break
                sampler.append(session, [0], [ids])
            episodes.append(ep)
    return episodes
