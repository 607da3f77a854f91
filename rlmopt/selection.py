"""Final selection (docs/rlmopt.md, Final selection): the seed, every commit, the agent's claimed
best and the polish variants of the running best are scored on validation (not charged); the
Pareto frontier over per-field scores is formed and its highest-composite member (ties: the
earliest in that order, so the seed wins a tie) is evaluated once on the sealed test split.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from rlmopt.harness import Evaluation, Harness
from rlmopt.lm import BackendError
from rlmopt.task import Candidate, placeholders

DEMO_HEADER = "Worked examples (input -> output):"


def dominates(a: Mapping[str, float], b: Mapping[str, float]) -> bool:
    """a >= b on every field and > on at least one."""
    return all(a[f] >= b[f] for f in b) and any(a[f] > b[f] for f in b)


def pareto_frontier(scores: Sequence[Mapping[str, float]]) -> list[int]:
    """Indices of the non-dominated score vectors, in input order."""
    return [i for i, s in enumerate(scores)
            if not any(dominates(t, s) for j, t in enumerate(scores) if j != i)]


def pick(evals: Sequence[Evaluation]) -> int:
    """Index of the highest composite on the Pareto frontier (the earliest on ties)."""
    frontier = pareto_frontier([e.fields for e in evals])
    return max(frontier, key=lambda i: (evals[i].composite, -i))


def opening_statement(text: str) -> str:
    """The seed's task statement: its first paragraph, or its first sentence if one paragraph."""
    para = text.strip().split("\n\n")[0].strip()
    if "\n" in para or len(para) > 400:
        m = re.match(r"(.+?[.!?])(\s|$)", para, re.S)
        para = m.group(1) if m else para
    return para


def main_component(candidate: Candidate) -> str:
    return "system_prompt" if "system_prompt" in candidate else next(iter(candidate))


async def polish_variants(h: Harness) -> list[tuple[str, Candidate]]:
    """Up to five (label, candidate) variants of the running best: the seed's opening statement
    re-attached; +k training demos for k in config.polish_demos; a sub-LM rewrite (discarded when
    under half the source length or when it drops a template variable)."""
    best, seed = h.best, h.seed
    main = main_component(best)
    variants: list[tuple[str, Candidate]] = []
    opening = opening_statement(seed.get(main, ""))
    if opening and opening not in best[main]:
        variants.append(("polish:seed_statement", {**best, main: opening + "\n\n" + best[main]}))
    train = h.splits.train
    target = "demonstrations" if "demonstrations" in best else main
    for k in h.config.polish_demos:
        if k > len(train):
            continue
        demos = "\n\n".join(h.task.format_demo(e) for e in train[:k])
        base = best[target].split(DEMO_HEADER)[0].rstrip()
        text = f"{base}\n\n{DEMO_HEADER}\n\n{demos}".lstrip()
        variants.append((f"polish:demos{k}", {**best, target: text}))
    if h.sub_lm is not None:
        source = best[main]
        ask = ("Rewrite the following instruction prompt so it is clearer and better organised. "
               "Keep every rule, fact, table and template variable in braces; do not shorten it. "
               "Reply with the rewritten prompt only.\n\n-----\n" + source)
        try:
            text = (await h.sub_lm.complete(ask, max(256, len(source) // 2))).text.strip()
        except BackendError:
            text = ""
        text = re.sub(r"^```\w*\n|\n```$", "", text)
        rewrite = {**best, main: text}
        if len(text) >= len(source) / 2 and placeholders(best) <= placeholders(rewrite):
            variants.append(("polish:rewrite", rewrite))
    return variants


@dataclass
class FinalResult:
    chosen_id: str
    chosen_label: str
    val: Evaluation
    test: Evaluation
    seed_val: Evaluation
    seed_test: Evaluation
    pool: list[dict]  # label, candidate id, composite, fields, on_frontier


async def finalize(h: Harness) -> FinalResult:
    """Builds the final pool, scores it on validation, picks, and evaluates the pick on test."""
    labelled: list[tuple[str, str]] = [("seed", h.state.seed_id)]
    labelled += [(f"commit{i + 1}", c) for i, c in enumerate(h.state.commits)]
    if h.state.claimed_id:
        labelled.append(("claimed", h.state.claimed_id))
    if h.config.polish_variants:
        for label, cand in await polish_variants(h):
            labelled.append((label, h.register(cand)))
    seen: dict[str, str] = {}
    for label, cid in labelled:
        seen.setdefault(cid, label)
    ids = list(seen)
    evals = [(await h.evaluate(cid, h.val_order))[0] for cid in ids]
    frontier = set(pareto_frontier([e.fields for e in evals]))
    chosen = ids[pick(evals)]
    test_ids = [e.id for e in h.splits.test]
    test, _ = await h.evaluate(chosen, test_ids)
    seed_test, _ = await h.evaluate(h.state.seed_id, test_ids)
    pool = [{"label": seen[c], "candidate_id": c, "composite": e.composite, "fields": e.fields,
             "on_frontier": i in frontier, "chars": sum(map(len, h.state.candidates[c].values()))}
            for i, (c, e) in enumerate(zip(ids, evals))]
    h.state.phase = "done"
    h.save()
    return FinalResult(chosen, seen[chosen], evals[ids.index(chosen)], test,
                       evals[0], seed_test, pool)
