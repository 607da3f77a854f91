"""Per-field metrics: each maps (prediction, gold) -> score in [0, 1].

Text metrics normalise as SQuAD does (lower case, drop punctuation and the articles a/an/the,
collapse whitespace). Trajectory metrics read a tool-call trajectory: a list of
{"name": str, "arguments": dict} (a JSON string of that list is parsed first). `METRICS` is the
catalog a task's field spec names metrics from; `composite` is S(p) = sum_f w_f s_f(p).
"""
from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any, Callable, Mapping, Sequence

from workflow_r1.task.reward import normalize_answer


def normalize(text: Any) -> str:
    """SQuAD-style normalisation of a string (non-strings are str()-ed): the workflow reward's own
    `normalize_answer`, so an exact match here is an exact match there."""
    return normalize_answer(str(text))


def _golds(gold: Any) -> list:
    return list(gold) if isinstance(gold, (list, tuple)) and gold and not isinstance(gold[0], dict) \
        else [gold]


def exact_match(pred: Any, gold: Any) -> float:
    """1 if the normalised prediction equals a normalised gold (gold may be a list of aliases)."""
    p = normalize(pred)
    return float(any(p == normalize(g) for g in _golds(gold)))


def token_f1(pred: Any, gold: Any) -> float:
    """Best token-overlap F1 over the gold aliases."""
    best = 0.0
    ptoks = normalize(pred).split()
    for g in _golds(gold):
        gtoks = normalize(g).split()
        common = sum((Counter(ptoks) & Counter(gtoks)).values())
        if not ptoks or not gtoks:
            best = max(best, float(ptoks == gtoks))
        elif common:
            prec, rec = common / len(ptoks), common / len(gtoks)
            best = max(best, 2 * prec * rec / (prec + rec))
    return best


def label_match(pred: Any, gold: Any) -> float:
    """1 if the normalised prediction starts with the normalised gold label as whole tokens
    ("True. Because ..." matches "true")."""
    ptoks = normalize(pred).split()
    for g in _golds(gold):
        gtoks = normalize(g).split()
        if gtoks and ptoks[: len(gtoks)] == gtoks:
            return 1.0
    return 0.0


def _as_list(value: Any) -> list:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = [v for v in re.split(r"[\n;,]", value) if v.strip()]
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple, set)) else [value]


def set_match(pred: Any, gold: Any) -> float:
    """Graded overlap of two sets of normalised strings: F1 of the sets; 1 when both are empty."""
    p = {normalize(v) for v in _as_list(pred)} - {""}
    g = {normalize(v) for v in _as_list(gold)} - {""}
    if not p and not g:
        return 1.0
    common = len(p & g)
    return 0.0 if not common else 2 * common / (len(p) + len(g))


def span_match(pred: Any, gold: Any) -> float:
    """1 if a normalised gold span occurs inside the normalised prediction, else token F1."""
    p = normalize(pred)
    if any(normalize(g) and normalize(g) in p for g in _golds(gold)):
        return 1.0
    return token_f1(pred, gold)


def constraint_pass(pred: Any, gold: Any) -> float:
    """Fraction of constraints the prediction satisfies. `gold` is a list of checks, each
    {"type": "contains"|"not_contains"|"max_words"|"min_words"|"regex"|"startswith", "value": ...}."""
    checks = gold if isinstance(gold, list) else [gold]
    text = str(pred)
    if not checks:
        return 1.0
    passed = 0
    for c in checks:
        kind, value = c["type"], c["value"]
        ok = {
            "contains": lambda: str(value).lower() in text.lower(),
            "not_contains": lambda: str(value).lower() not in text.lower(),
            "max_words": lambda: len(text.split()) <= int(value),
            "min_words": lambda: len(text.split()) >= int(value),
            "regex": lambda: re.search(str(value), text) is not None,
            "startswith": lambda: text.strip().lower().startswith(str(value).lower()),
        }.get(kind)
        if ok is None:
            raise ValueError(f"constraint type {kind!r} unknown; use contains, not_contains, "
                             "max_words, min_words, regex or startswith")
        passed += bool(ok())
    return passed / len(checks)


# -- trajectories ---------------------------------------------------------------------------------

def parse_calls(value: Any) -> list[dict] | None:
    """A trajectory as a list of {"name", "arguments"} dicts, or None when it is not valid JSON of
    that shape."""
    if isinstance(value, str):
        text = value.strip()
        fence = re.search(r"```(?:json)?\s*(.*?)```", text, re.S)
        if fence:
            text = fence.group(1)
        try:
            value = json.loads(text)
        except ValueError:
            return None
    if not isinstance(value, list):
        return None
    calls = []
    for call in value:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        args = call.get("arguments", {})
        calls.append({"name": call["name"], "arguments": args if isinstance(args, dict) else {}})
    return calls


def json_valid(pred: Any, gold: Any) -> float:
    """1 if the prediction parses as a tool-call trajectory."""
    return float(parse_calls(pred) is not None)


def _names(calls: list[dict] | None) -> Counter:
    return Counter(c["name"] for c in calls or [])


def tool_precision(pred: Any, gold: Any) -> float:
    """Share of predicted calls whose tool appears in the gold (multiset); 1 when neither calls a
    tool (declining correctly), 0 for calls when none were needed."""
    p, g = _names(parse_calls(pred)), _names(parse_calls(gold))
    if not p:
        return float(not g)
    return sum((p & g).values()) / sum(p.values())


def tool_recall(pred: Any, gold: Any) -> float:
    """Share of gold calls whose tool was predicted (multiset); 1 when no call was needed."""
    p, g = _names(parse_calls(pred)), _names(parse_calls(gold))
    if not g:
        return float(not p)
    return sum((p & g).values()) / sum(g.values())


def argument_match(pred: Any, gold: Any) -> float:
    """Mean over gold calls of the share of its arguments matched by the first unused predicted
    call of the same tool (values compared after normalisation)."""
    p, g = parse_calls(pred) or [], parse_calls(gold) or []
    if not g:
        return float(not p)
    used: set[int] = set()
    total = 0.0
    for gc in g:
        for i, pc in enumerate(p):
            if i not in used and pc["name"] == gc["name"]:
                used.add(i)
                keys = gc["arguments"].keys()
                total += 1.0 if not keys else sum(
                    normalize(pc["arguments"].get(k)) == normalize(v)
                    for k, v in gc["arguments"].items()) / len(keys)
                break
    return total / len(g)


def sequence_match(pred: Any, gold: Any) -> float:
    """1 if the predicted calls equal the gold calls in order (names and normalised arguments)."""
    p, g = parse_calls(pred), parse_calls(gold)
    if p is None or g is None or len(p) != len(g):
        return 0.0
    return float(all(a["name"] == b["name"] and
                     {k: normalize(v) for k, v in a["arguments"].items()} ==
                     {k: normalize(v) for k, v in b["arguments"].items()} for a, b in zip(p, g)))


def final_state_equal(pred: Any, gold: Any) -> float:
    """1 if two environment states (JSON objects) are equal."""
    def load(v: Any) -> Any:
        if isinstance(v, str):
            try:
                return json.loads(v)
            except ValueError:
                return v
        return v
    return float(load(pred) == load(gold))


METRICS: dict[str, Callable[[Any, Any], float]] = {
    "exact_match": exact_match, "token_f1": token_f1, "label_match": label_match,
    "set_match": set_match, "span_match": span_match, "constraint_pass": constraint_pass,
    "sequence_match": sequence_match, "tool_precision": tool_precision,
    "tool_recall": tool_recall, "argument_match": argument_match,
    "final_state_equal": final_state_equal, "json_valid": json_valid,
}


def get_metric(name: str) -> Callable[[Any, Any], float]:
    if name not in METRICS:
        raise ValueError(f"metric {name!r} unknown; use one of {', '.join(sorted(METRICS))}")
    return METRICS[name]


def composite(field_scores: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """S(p) = sum_f w_f s_f(p) with the weights renormalised to sum to 1."""
    total = sum(weights.values())
    return sum(weights[f] * field_scores[f] for f in weights) / total


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
