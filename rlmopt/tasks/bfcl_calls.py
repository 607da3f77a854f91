"""BFCL multi-turn calls: a task-LM reply decoded into calls, the calls executed in the
benchmark's own environment instances (the `bfcl-eval` package's `execute_multi_turn_func_call`),
and an episode scored by the package's multi-turn checker (rlmopt/tasks/bfcl_multi_turn.py is the
task around them).

Decoding. The benchmark's python-call format `[f(a=1, b='x'), g()]`, read as BFCL's prompting
decoder reads it (surrounding backticks/newlines stripped, brackets added, keyword arguments only,
a bare name argument taken as its text); or a JSON list of {"name", "arguments"} (or
{"function", "parameters"}), BFCL's json return format. Argument values must be literals
(numbers, strings, booleans, None, lists, dicts, tuples; + - * / on numbers): where BFCL's decoder
would evaluate other expressions or nested keyword calls, they are passed as their source text.
Calls are rendered `name(k=repr(v), ...)` for the package's executor, which `eval`s them: a name
that is not a public method of the entry's classes and that Python would resolve (a builtin, a
module global of the executor, a dotted path) is renamed so that it fails as an unknown function
instead of running.

Scoring, by the package's checker on the decoded calls of every step of every turn: `accuracy`
(weight 0.5) is BFCL's verdict (`multi_turn_checker` valid: after every turn with gold calls, the
environment state equals the gold trajectory's and every gold call's result is among the model's
results so far; a force-terminated episode fails), `state_match` and `response_match` (0.25 each)
are the shares of gold turns passing the checker's state and response sub-checks, each turn checked
(the checker stops at the first failure). BFCL's leaderboard number is the `accuracy` field.
"""
from __future__ import annotations

import ast
import builtins
import json
import operator
import re
import threading
import uuid
from typing import Any, Mapping

from rlmopt.tasks import bfcl_package

_lock = threading.Lock()  # the package's executor keeps instances in its module globals


# -- decoding --------------------------------------------------------------------------------------

_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
          ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def _value(node: ast.AST) -> Any:
    """A keyword argument's value, as BFCL's decoder reads it, without evaluating code."""
    if isinstance(node, ast.Constant):
        return "..." if node.value is Ellipsis else node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        a, b = _value(node.left), _value(node.right)
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
            try:
                return _ARITH[type(node.op)](a, b)
            except ZeroDivisionError:
                pass
    if isinstance(node, ast.List):
        return [_value(v) for v in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_value(v) for v in node.elts)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_value(k): _value(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, (ast.Call, ast.Subscript, ast.BinOp, ast.UnaryOp, ast.Attribute)):
        return ast.unparse(node)
    raise ValueError(f"unsupported argument {ast.dump(node)[:60]}")


def _call_name(func: ast.AST) -> str:
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        raise ValueError("a call's function is not a name")
    return ".".join(reversed(parts + [func.id]))


def _call_text(name: str, arguments: Mapping[str, Any]) -> str:
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"


def _decode_python(text: str) -> list[str]:
    text = text.strip("`\n ")
    text = ("" if text.startswith("[") else "[") + text + ("" if text.endswith("]") else "]")
    body = ast.parse(text.strip().strip("'"), mode="eval").body
    calls = [body] if isinstance(body, ast.Call) else list(getattr(body, "elts", None) or [])
    if not isinstance(body, (ast.Call, ast.List, ast.Tuple)) or \
            not all(isinstance(c, ast.Call) for c in calls):
        raise ValueError("not a list of calls")
    out = []
    for c in calls:
        if any(k.arg is None for k in c.keywords):
            raise ValueError("**arguments")
        out.append(_call_text(_call_name(c.func), {k.arg: _value(k.value) for k in c.keywords}))
    return out


def _decode_json(text: str) -> list[str]:
    match = re.search(r"\[.*\]", text, re.S)
    items = json.loads(match.group(0)) if match else None
    if not isinstance(items, list):
        raise ValueError("not a JSON list")
    out = []
    for it in items:
        name = it.get("name", it.get("function")) if isinstance(it, dict) else None
        args = it.get("arguments", it.get("parameters", {})) if isinstance(it, dict) else None
        if not isinstance(name, str) or not isinstance(args, dict) or \
                not all(isinstance(k, str) and k.isidentifier() for k in args):
            raise ValueError("not a {name, arguments} object")
        out.append(_call_text(name, args))
    return out


def decode(reply: str) -> list[str] | None:
    """The reply's calls as executable strings (`name(k=repr(v), ...)`), [] for no call, or None
    when the reply is neither format (the turn ends either way)."""
    for decoder in (_decode_python, _decode_json):
        try:
            return decoder(reply)
        except (SyntaxError, ValueError, TypeError, RecursionError):
            continue
    return None


# -- execution and checking ------------------------------------------------------------------------

def _utils():
    bfcl_package.load()
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    return multi_turn_utils


def _methods(involved: list[str]) -> set[str]:
    """The public methods of the entry's environment classes (the names the executor maps)."""
    import importlib
    _utils()
    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING
    names = set()
    for c in involved:
        cls = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[c]), c)
        names |= {m for m in dir(cls) if not m.startswith("_") and callable(getattr(cls, m))}
    return names


def guard(calls: list[str], methods: set[str]) -> list[str]:
    """`calls` with every function the executor would resolve outside the environment (a builtin,
    a module global, a dotted path) renamed to an undefined name, so it fails as unknown."""
    resolvable = set(vars(builtins)) | set(vars(_utils()))
    out = []
    for call in calls:
        name = call.split("(", 1)[0]
        if name not in methods and ("." in name or name in resolvable):
            call = "unknown_function_" + re.sub(r"\W", "_", name) + call[len(name):]
        out.append(call)
    return out


class Session:
    """The package's executor over one entry's environment instances, which it keeps (between
    calls of one session) in its module globals under a name unique to this session; `close`
    removes them."""

    def __init__(self, entry: Mapping[str, Any]):
        self.entry = entry
        self.tag = f"rlmopt_{uuid.uuid4().hex}"
        self.methods = _methods(entry["involved_classes"])
        category = entry["id"].rsplit("_", 1)[0]
        self.long_context = "long_context" in category or "composite" in category

    def run(self, calls: list[str], who: str = "model", eval_run: bool = False
            ) -> tuple[list[str], dict]:
        """Executes `calls` in order in `who`'s instances; (result strings, instances)."""
        with _lock:
            return _utils().execute_multi_turn_func_call(
                guard(calls, self.methods), self.entry["initial_config"],
                self.entry["involved_classes"], f"{self.tag}_{who}", self.entry["id"],
                long_context=self.long_context, is_evaL_run=eval_run)

    def close(self) -> None:
        with _lock:
            space = vars(_utils())
            for key in [k for k in space if k.startswith(self.tag)]:
                del space[key]

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check(decoded: list[list[list[str]]], entry: Mapping[str, Any]) -> dict[str, float]:
    """The three fields for one episode's decoded calls (per turn, per step, call strings)."""
    gold = entry["ground_truth"]
    checker = _checker()
    steps = [[guard(s, _methods(entry["involved_classes"])) for s in turn if s]
             for turn in decoded]
    accuracy = 0.0
    if len(steps) == len(gold):  # else force-terminated: BFCL fails the entry unchecked
        with Session(entry) as s, _lock:
            accuracy = float(checker.multi_turn_checker(steps, gold, dict(entry),
                                                        entry["id"].rsplit("_", 1)[0],
                                                        s.tag)["valid"])
    state = response = 0
    so_far: list[str] = []
    with Session(entry) as s:
        for k, gold_calls in enumerate(gold):
            model = None
            for step in (steps[k] if k < len(steps) else []):
                results, model = s.run(step, "model", eval_run=True)
                so_far += results
            if model is None:  # no call this turn: the instances as they stand
                _, model = s.run([], "model", eval_run=True)
            gold_results, gold_inst = s.run(gold_calls, "gold", eval_run=True)
            if not gold_calls:
                continue
            state += checker.state_checker(model, gold_inst)["valid"]
            response += checker.response_checker(so_far, gold_results, k)["valid"]
    turns = sum(1 for g in gold if g) or 1
    return {"accuracy": accuracy, "state_match": state / turns, "response_match": response / turns}


def _checker():
    _utils()
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker
    return multi_turn_checker
