"""BFCL multi-turn on the pinned `bfcl-eval` wheel (rlmopt/tasks/bfcl_multi_turn.py): gold
trajectories score 1 and perturbed ones 0 under the package's checker; our scoring of recorded
trajectories equals BFCL's own pipeline (its prompting decoder, read from the package's source, then
its multi-turn checker); the environments execute calls and refuse what is not theirs; episodes run
turn by turn (held-out functions, step limit); GEPA and rlmopt run on the task. The entries are a
fixed handful drawn from the package at test time."""
from __future__ import annotations

import ast
import asyncio
import json
import re
import uuid

import pytest

from rlmopt.config import RLMOptConfig
from rlmopt.lm import FunctionLM
from rlmopt.pipeline import load_task, optimise
from rlmopt.task import split
from rlmopt.tasks import bfcl_multi_turn as bfcl
from rlmopt.tasks import bfcl_package

BASE_IDS = [0, 1, 50, 100, 150, 199]  # file system + posting, file system, vehicle, trading,
# travel, messaging + travel


@pytest.fixture(scope="module")
def base():
    entries = {e["id"]: e for e in bfcl.load_entries("base")}
    return [entries[f"multi_turn_base_{i}"] for i in BASE_IDS]


def _gold(entry):
    """One step per turn holding the turn's gold calls (decoded form)."""
    return [[g] if g else [] for g in entry["ground_truth"]]


def _kw(call):
    """A gold call with its positional arguments named (BFCL's decoder reads keywords only)."""
    node = ast.parse(call, mode="eval").body
    if not node.args:
        return call
    name = node.func.id
    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING
    import importlib
    import inspect
    for module in CLASS_FILE_PATH_MAPPING.values():
        if module.endswith(("memory_vector", "web_search", "memory_kv", "memory_rec_sum")):
            continue
        for cls in vars(importlib.import_module(module)).values():
            if inspect.isclass(cls) and hasattr(cls, name):
                params = list(inspect.signature(getattr(cls, name)).parameters)[1:]
                kws = [f"{p}={ast.unparse(a)}" for p, a in zip(params, node.args)]
                return f"{name}({', '.join(kws + [ast.unparse(k) for k in node.keywords])})"
    raise AssertionError(name)


def test_gold_trajectories_score_one_and_perturbed_ones_zero(base):
    extra = [next(e for e in bfcl.load_entries(s) if e["id"].endswith("_0"))
             for s in ("long_context", "miss_func", "miss_param")]
    for entry in base + extra:
        assert bfcl.check(_gold(entry), entry) == {"accuracy": 1.0, "state_match": 1.0,
                                                   "response_match": 1.0}, entry["id"]
    for entry in base:
        gold, steps = entry["ground_truth"], _gold(entry)
        last = max(k for k, t in enumerate(gold) if t)
        dropped = [list(s) for s in steps]  # the last gold call left out
        dropped[last] = [gold[last][:-1]] if len(gold[last]) > 1 else []
        scores = bfcl.check(dropped, entry)
        assert scores["accuracy"] == 0.0, entry["id"]
        assert min(scores["state_match"], scores["response_match"]) < 1.0
        assert bfcl.check(steps[:-1], entry)["accuracy"] == 0.0  # force-terminated: a turn short
    # the per-turn fields: turn 2 of 4 wrong (base_0's grep on another file) costs that turn only
    entry = base[0]
    wrong = _gold(entry)
    wrong[1] = [[c.replace("final_report.pdf", "previous_report.pdf") for c in wrong[1][0]]]
    assert bfcl.check(wrong, entry) == {"accuracy": 0.0, "state_match": 1.0,
                                        "response_match": 0.75}


def _upstream_decoder():
    """BFCL's prompting decoder (`default_decode_execute_prompting` and the functions it calls),
    compiled from the package's source: its module imports tree-sitter and tenacity."""
    root = bfcl_package.load()
    path = root / "bfcl_eval" / "model_handler" / "utils.py"
    keep = {"ast_parse", "resolve_ast_call", "resolve_ast_by_type", "parse_nested_value",
            "default_decode_execute_prompting", "decoded_output_to_execution_list"}
    tree = ast.parse(path.read_text())
    module = ast.Module([n for n in tree.body if isinstance(n, ast.FunctionDef)
                         and n.name in keep], [])
    from bfcl_eval.constants.enums import ReturnFormat
    space = {"ast": ast, "re": re, "ReturnFormat": ReturnFormat}
    exec(compile(module, str(path), "exec"), space)
    assert keep <= set(space)
    return space["default_decode_execute_prompting"]


def _upstream_verdict(raw_turns, entry, decode):
    """BFCL's pipeline on raw replies (eval_runner's multi-turn entry check): decode each step,
    skip what does not decode or is empty, fail a force-terminated entry, else the checker."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker, multi_turn_utils
    if len(raw_turns) != len(entry["ground_truth"]):
        return False
    decoded = []
    for turn in raw_turns:
        steps = []
        for reply in turn:
            try:
                calls = decode(reply)
            except Exception:
                continue
            if calls and calls != [""]:
                steps.append(calls)
        decoded.append(steps)
    tag = f"reference_{uuid.uuid4().hex}"
    try:
        return multi_turn_checker.multi_turn_checker(
            decoded, entry["ground_truth"], dict(entry), entry["id"].rsplit("_", 1)[0],
            tag)["valid"]
    finally:
        for key in [k for k in vars(multi_turn_utils) if k.startswith(tag)]:
            del vars(multi_turn_utils)[key]


def _recorded(entry):
    """Raw-reply trajectories: the gold calls as one reply per turn, one call per reply with a
    closing text, with a call missing, with a changed argument, with an unknown function added,
    with a prose turn, a turn short."""
    gold = [[_kw(c) for c in turn] for turn in entry["ground_truth"]]
    as_list = [[f"[{', '.join(t)}]"] if t else ["Nothing to do."] for t in gold]
    yield as_list, True
    yield [[c for c in t] + ["All done."] for t in gold], True
    last = max(k for k, t in enumerate(gold) if t)
    yield [r if k != last else [f"[{', '.join(gold[k][:-1])}]"] for k, r in enumerate(as_list)], \
        False
    changed = [list(r) for r in as_list]
    changed[last] = [re.sub(r"='[^']*'", "='zzz'", changed[last][0], count=1)]
    yield changed, None
    yield [[r[0].replace("[", "[foo(x=1), ", 1)] for r in as_list], None
    yield [["```\n" + r[0] + "\n```"] for r in as_list], None
    yield [["I will do that now."]] + as_list[1:], None
    yield as_list[:-1], False


def test_scoring_equals_bfcls_own_decoder_and_checker_on_recorded_trajectories(base):
    decode = _upstream_decoder()
    seen = set()
    for entry in base:
        for raw, expect in _recorded(entry):
            for turn in raw:
                for reply in turn:
                    try:
                        theirs = decode(reply)
                    except Exception:
                        theirs = None
                    ours = bfcl.decode(reply)
                    if theirs is not None and theirs != [""]:
                        assert ours == theirs, reply
            reference = _upstream_verdict(raw, entry, decode)
            ours = [[bfcl.decode(r) or [] for r in turn] for turn in raw]
            scores = bfcl.check(ours, entry)
            assert scores["accuracy"] == float(reference), (entry["id"], raw)
            if expect is not None:
                assert reference is expect
            seen.add(reference)
    assert seen == {True, False}


def test_the_environment_executes_calls_and_refuses_what_is_not_its_own(base, tmp_path):
    entry = base[1]  # GorillaFileSystem only
    with bfcl.Session(entry) as env:
        results, instances = env.run(["mkdir(dir_name='made_here')", "ls()"])
        assert results[0] == "None" and "made_here" in json.loads(results[1])[
            "current_directory_content"]
        fs = instances["GorillaFileSystem"]
        assert "made_here" in fs._current_dir.contents
        later, _ = env.run(["cd(folder='made_here')", "pwd()"])  # state persists between steps
        assert json.loads(later[1])["current_working_directory"].endswith("/made_here")
        marker = tmp_path / "touched"
        bad = bfcl.guard([f"open(file={str(marker)!r}, mode='w')", "os.system(command='true')",
                          "__import__(name='os')", "ls()"], env.methods)
        assert bad[:3] == [f"unknown_function_open(file={str(marker)!r}, mode='w')",
                           "unknown_function_os_system(command='true')",
                           "unknown_function___import__(name='os')"] and bad[3] == "ls()"
        refused, _ = env.run([f"open(file={str(marker)!r}, mode='w')", "__import__(name='os')"])
        assert all(r.startswith("Error during execution: name 'unknown_function_") for r in refused)
        assert not marker.exists()
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    assert not [k for k in vars(multi_turn_utils) if k.startswith(env.tag)]  # closed: released


def _prompts_lm(reply):
    prompts = []

    def answer(prompt):
        prompts.append(prompt)
        return reply(prompt)
    return FunctionLM(answer), prompts


def test_an_episode_runs_turn_by_turn_with_held_out_functions_and_a_step_limit():
    task = bfcl.build("miss_func,n=1,steps=2")
    ex = task.examples[0]
    entry = task.entries[ex.id]
    held = [d["name"] for docs in entry["holdout"].values() for d in docs]
    assert held == ["sort"]
    second = entry["question"][1][0]["content"]
    lm, prompts = _prompts_lm(lambda p: "No calls." if second in p else "[ls()]")
    episode = bfcl.BfclEpisodeLM(lm, task)
    reply = asyncio.run(episode.complete(task.render(task.seed_candidate, ex), 256)).text
    trace = json.loads(reply)
    assert len(trace["turns"]) == 1 and len(trace["turns"][0]) == 3  # steps 1..3, then stopped
    assert trace["error"].startswith("force-terminated") and episode.llm_calls == 3
    assert task.score(task.parse(reply), ex)["accuracy"] == 0.0
    lm, prompts = _prompts_lm(lambda p: "Nothing to call.")
    reply = asyncio.run(bfcl.BfclEpisodeLM(lm, task).complete(
        task.render(task.seed_candidate, ex), 256)).text
    assert len(json.loads(reply)["turns"]) == len(entry["question"])
    k = next(iter(entry["holdout"]))
    assert '"name": "sort"' not in prompts[k - 1] and '"name": "sort"' in prompts[k]
    assert bfcl.ADDED_FUNCTIONS in prompts[k]


def test_the_task_splits_by_seed_and_rejects_bad_specs():
    task = load_task("bfcl_multi_turn:base,docs=compact,n=20")
    s = split(task, seed=7)
    assert s.sizes() == {"train": 8, "val": 6, "test": 6}
    assert split(task, seed=7) == s and split(task, seed=8).val != s.val
    assert list(task.seed_candidate) == ["system_prompt", "tool_guidance", "demonstrations"]
    prompt = json.loads(task.render(task.seed_candidate, task.examples[0]))["system"]
    assert "in compact format" in prompt and "- cd(folder: string): Change" in prompt
    for spec in ("bfcl_multi_turn:web", "bfcl_multi_turn:base,steps=0", "bfcl_multi_turn:x=1"):
        with pytest.raises(ValueError, match="bfcl_multi_turn"):
            load_task(spec)


@pytest.mark.parametrize("method", ["gepa", "rlmopt"])
def test_gepa_and_rlmopt_run_on_the_task(tmp_path, method):
    """The simulated assistant answers in bare call lists only when asked (bfcl.RULE); GEPA sees
    and edits only the system prompt, the scripted rlmopt agent writes the tool guidance."""
    from rlmopt.pipeline import build_optimizer_lm, build_task_lm
    task = load_task("bfcl_multi_turn:base,n=12")
    config = RLMOptConfig(budget=12, polish_variants=False, seed=7, sandbox="best_effort")
    rec = asyncio.run(optimise(
        task, config, method=method, task_lm=build_task_lm(task, "simulated"),
        optimizer_lm=build_optimizer_lm(task, "scripted", method), sub_lm=None, judge_lm=None,
        run_dir=tmp_path, names={"task": "simulated", "optimizer": "scripted"},
        log=lambda s: None))
    assert rec["bench"] == "bfcl_multi_turn"
    assert set(rec["test_fields"]) == set(rec["seed_test_fields"]) == {
        "accuracy", "state_match", "response_match"}
    assert rec["test_fields"]["accuracy"] > rec["seed_test_fields"]["accuracy"] == 0.0
    assert rec["val_score"] > rec["seed_val_score"] and rec["test_score"] > rec["seed_test_score"]
    state = json.loads((tmp_path / "state.json").read_text())["state"]
    chosen = state["candidates"][rec["chosen"]["candidate_id"]]
    if method == "gepa":
        assert rec["extra"]["gepa"]["components"] == ["system_prompt"]
        assert bfcl.RULE in chosen["system_prompt"] and chosen["tool_guidance"] == ""
    else:
        assert bfcl.RULE in chosen["tool_guidance"]


def test_a_damaged_cache_is_unpacked_again_and_wheel_faults_are_one_line(tmp_path, monkeypatch):
    """The unpacked package is checked against its digest at every load: a deleted possible-answer
    file or an emptied file is unpacked again from the wheel. A garbage wheel in the wheelhouse is a
    sha256 mismatch naming it; no index reachable names the variable that supplies the wheel."""
    import subprocess as sp

    from workflow_r1.assets import wheels
    from workflow_r1.assets.registry import AssetError

    root = bfcl_package.ensure(tmp_path / "cache")  # pip downloads the pinned wheel
    answers = root / "bfcl_eval" / "data" / "possible_answer" / "BFCL_v4_multi_turn_base.json"
    first = answers.read_bytes()
    answers.unlink()
    (root / "bfcl_eval" / "data" / "BFCL_v4_multi_turn_base.json").write_text("")
    assert not bfcl_package._complete(root)
    wheel_bytes = {}
    real_download = wheels.pip_download

    def keep(part, dest, **kw):  # the second unpack's wheel, kept for the wheelhouse below
        w = real_download(part, dest, **kw)
        wheel_bytes["x"] = w.read_bytes()
        return w

    monkeypatch.setattr(bfcl_package, "pip_download", keep)
    assert bfcl_package.ensure(tmp_path / "cache") == root and answers.read_bytes() == first
    assert bfcl_package._complete(root)
    house = tmp_path / "house"
    house.mkdir()
    (house / bfcl_package.WHEEL.wheel_filename).write_bytes(wheel_bytes["x"][:1000])  # truncated
    monkeypatch.setenv(bfcl_package.WHEELHOUSE_ENV, str(house))
    with pytest.raises(AssetError, match=r"^sha256 mismatch for .*bfcl_eval-.*\.whl: expected .* delete it and retry"):
        bfcl_package.ensure(tmp_path / "other")
    monkeypatch.delenv(bfcl_package.WHEELHOUSE_ENV)
    monkeypatch.setattr(bfcl_package, "pip_download", real_download)
    monkeypatch.setattr(wheels.subprocess, "run", lambda *a, **k: sp.CompletedProcess(
        a, 1, "", "ERROR: Could not find a version (Failed to establish a new connection)"))
    with pytest.raises(AssetError) as e:
        bfcl_package.ensure(tmp_path / "third")
    assert "\n" not in str(e.value) and str(e.value).endswith(
        f"or set ${bfcl_package.WHEELHOUSE_ENV} to a directory holding {bfcl_package.WHEEL.wheel_filename}")
