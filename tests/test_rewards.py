"""PPO reward functions (`rlhf_trl.rewards`): loading, one-line errors, weighted sums, columns from prompt records,
and the demo's ground truth as a reward function."""

import logging
import math
import sys
import textwrap
import uuid

import numpy as np
import pytest
import torch

from rlhf_trl import demo_task as dt
from rlhf_trl import rewards as rw
from rlhf_trl.data import DataArguments, Template, read_records
from rlhf_trl.rewards import RewardFunctionError, RewardFunctions, load_reward_functions, reward_columns

from conftest import write_jsonl

GT = "rlhf_trl.demo_task:ground_truth_reward"

FUNCTIONS = '''
import numpy as np
import torch


def count(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def half(prompts, completions, **kwargs):
    return [0.5] * len(completions)


def named_only(prompts, completions, topic):
    return [1.0 if t in c else 0.0 for c, t in zip(completions, topic)]


def wants_columns(prompts, completions, question, topic, **kwargs):
    assert question == ["q0", "q1"] and topic == ["t0", None] and kwargs == {"system": [None, None]}
    return [1, True]


class Scorer:
    @staticmethod
    def score(prompts, completions, **kwargs):
        return np.ones(len(completions), dtype=np.float32)


def raises_keyerror(prompts, completions, **kwargs):
    return [{}["x"] for _ in completions]


def raises_multiline(prompts, completions, **kwargs):
    raise ValueError("bad\\n  thing")


def raises_bare(prompts, completions, **kwargs):
    raise RuntimeError()


def too_few(prompts, completions, **kwargs):
    return [0.0] * (len(completions) - 1)


def scalar(prompts, completions, **kwargs):
    return 1.0


def text(prompts, completions, **kwargs):
    return "1234"


def nothing(prompts, completions, **kwargs):
    return None


def generator(prompts, completions, **kwargs):
    return (0.0 for _ in completions)


def with_nan(prompts, completions, **kwargs):
    return [0.0, float("nan"), 0.0, 0.0]


def with_inf(prompts, completions, **kwargs):
    return [0.0, 0.0, float("-inf"), 0.0]


def with_none(prompts, completions, **kwargs):
    return [0.0, None, 0.0, 0.0]


def with_string(prompts, completions, **kwargs):
    return [0.0, 0.0, 0.0, "0.5"]


def with_list(prompts, completions, **kwargs):
    return [[0.0], [0.0], [0.0], [0.0]]


def tensor_2d(prompts, completions, **kwargs):
    return torch.zeros(len(completions), 1)


def tensor_ok(prompts, completions, **kwargs):
    return torch.arange(len(completions), dtype=torch.float64)
'''


def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


@pytest.fixture()
def pkg(tmp_path, monkeypatch):
    """An importable package (unique name) holding the test reward functions in ``<pkg>.fns``."""
    name = f"rwtest_{uuid.uuid4().hex[:8]}"
    root = tmp_path / "site" / name
    root.mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "fns.py").write_text(FUNCTIONS)
    (root / "boom.py").write_text("x = 1 / 0\n")
    (root / "needs.py").write_text("import no_such_dependency_xyz  # noqa\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return name


# ---------------------------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------------------------
def test_no_functions_is_none():
    assert load_reward_functions(None, None) is None
    assert load_reward_functions([], None) is None
    assert load_reward_functions([], []) is None


def test_load_by_module_path(pkg):
    rf = load_reward_functions([GT, f"{pkg}.fns:count", f"{pkg}.fns:Scorer.score"], [1.0, -0.5, 2])
    assert rf.specs == [GT, f"{pkg}.fns:count", f"{pkg}.fns:Scorer.score"]
    assert rf.names == ["ground_truth_reward", "count", "score"]
    assert rf.weights == [1.0, -0.5, 2.0] and all(type(w) is float for w in rf.weights)
    assert rf.functions[0] is dt.ground_truth_reward and len(rf) == 3
    assert load_reward_functions(GT, None).weights == [1.0]  # a single string is one entry; weights default to 1
    assert load_reward_functions([GT], []).weights == [1.0]
    with pytest.raises(ValueError, match=r"^reward_funcs: 2 entries for 1 functions$"):
        RewardFunctions([dt.ground_truth_reward], specs=[GT, GT])


def test_load_by_file_path_relative_to_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "rewards_dir").mkdir()
    (tmp_path / "rewards_dir" / "my_rewards.py").write_text(
        "def length(prompts, completions, **kwargs):\n    return [float(len(c)) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    rf = load_reward_functions(["rewards_dir/my_rewards.py:length", "./rewards_dir/my_rewards.py:length"], None)
    assert rf.names == ["length", "length_2"]
    assert rf.functions[0] is rf.functions[1]  # one file, imported once
    assert rf(["p", "p"], ["ab", "abc"], update=0).tolist() == [4.0, 6.0]


# every load error, exactly, in one line
def _load_errors(pkg, tmp):
    q = GT
    return [
        (["nocolon"], None, "reward_funcs[0]: 'nocolon' is not 'package.module:function' or 'path/to/file.py:function'"),
        ([q, "mod:"], None, "reward_funcs[1]: 'mod:' is not 'package.module:function' or 'path/to/file.py:function'"),
        ([":f"], None, "reward_funcs[0]: ':f' is not 'package.module:function' or 'path/to/file.py:function'"),
        (["a b:f"], None, "reward_funcs[0]: 'a b:f' is not 'package.module:function' or 'path/to/file.py:function'"),
        (["dir/mod:f"], None,
         "reward_funcs[0]: 'dir/mod:f' is not 'package.module:function' or 'path/to/file.py:function'"),
        ([3], None, "reward_funcs[0]: 3 is not 'package.module:function' or 'path/to/file.py:function'"),
        (["no_such_pkg_xyz.mod:f"], None, "reward_funcs[0] 'no_such_pkg_xyz.mod:f': cannot import module "
                                          "'no_such_pkg_xyz.mod': ModuleNotFoundError: No module named 'no_such_pkg_xyz'"),
        ([f"{pkg}.boom:f"], None,
         f"reward_funcs[0] '{pkg}.boom:f': cannot import module '{pkg}.boom': ZeroDivisionError: division by zero"),
        ([f"{pkg}.needs:f"], None, f"reward_funcs[0] '{pkg}.needs:f': cannot import module '{pkg}.needs': "
                                   "ModuleNotFoundError: No module named 'no_such_dependency_xyz'"),
        (["missing.py:f"], None, f"reward_funcs[0] 'missing.py:f': file not found: {tmp}/missing.py"),
        (["broken.py:f"], None,
         f"reward_funcs[0] 'broken.py:f': cannot import file {tmp}/broken.py: RuntimeError: no GPU here"),
        (["rlhf_trl.demo_task:nope"], None,
         "reward_funcs[0] 'rlhf_trl.demo_task:nope': module 'rlhf_trl.demo_task' has no attribute 'nope'"),
        (["good.py:nope"], None, "reward_funcs[0] 'good.py:nope': file 'good.py' has no attribute 'nope'"),
        (["rlhf_trl.demo_task:TOPICS"], None,
         "reward_funcs[0] 'rlhf_trl.demo_task:TOPICS': 'TOPICS' is a list, not callable"),
        (["rlhf_trl.demo_task:sentiment"], None,
         "reward_funcs[0] 'rlhf_trl.demo_task:sentiment': takes no 'prompts' / 'completions' argument; a reward "
         "function is f(prompts, completions, **columns) -> list[float]"),
        ([q], [1.0, 2.0], "reward_weights: 2 weight(s) for 1 reward_funcs (one per function, in order)"),
        ([q, q], [1.0], "reward_weights: 1 weight(s) for 2 reward_funcs (one per function, in order)"),
        (None, [1.0], "reward_weights: 1 weight(s) but no reward_funcs"),
        ([q, q], [1.0, float("nan")], f"reward_weights[1]: nan (for '{q}') is not finite"),
        ([q], [float("inf")], f"reward_weights[0]: inf (for '{q}') is not finite"),
        ([q], ["1"], f"reward_weights[0]: '1' (for '{q}') is not a number"),
        ([q], [None], f"reward_weights[0]: None (for '{q}') is not a number"),
        ([q], [True], f"reward_weights[0]: True (for '{q}') is not a number"),
    ]


@pytest.mark.parametrize("case", range(len(_load_errors("P", "T"))))
def test_load_errors_are_one_line_naming_the_key_and_the_entry(case, pkg, tmp_path, monkeypatch):
    (tmp_path / "broken.py").write_text("raise RuntimeError('no GPU here')\n")
    (tmp_path / "good.py").write_text("def f(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    specs, weights, message = _load_errors(pkg, tmp_path)[case]
    with pytest.raises(ValueError) as err:
        load_reward_functions(specs, weights)
    assert one_line(err) == message


def test_a_local_file_named_as_a_module_gets_a_hint(tmp_path, monkeypatch):
    (tmp_path / "hint_rewards_xyz.py").write_text("def f(prompts, completions, **kw):\n    return []\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    with pytest.raises(ValueError) as err:
        load_reward_functions(["hint_rewards_xyz:f"], None)
    assert one_line(err) == ("reward_funcs[0] 'hint_rewards_xyz:f': cannot import module 'hint_rewards_xyz': "
                             "ModuleNotFoundError: No module named 'hint_rewards_xyz' (a local file: write "
                             "'hint_rewards_xyz.py:f')")


def test_weights_are_checked_before_anything_is_imported(pkg):
    with pytest.raises(ValueError, match=r"^reward_weights: 2 weight"):
        load_reward_functions(["no_such_pkg_xyz.mod:f"], [1.0, 2.0])
    assert f"{pkg}.boom" not in sys.modules


# ---------------------------------------------------------------------------------------------------------------
# calling: values, weights, columns
# ---------------------------------------------------------------------------------------------------------------
def test_weighted_sum_and_per_function_values_by_hand(pkg):
    rf = load_reward_functions([f"{pkg}.fns:count", f"{pkg}.fns:half", f"{pkg}.fns:count"], [2.0, -3.0, 0.25])
    assert rf.names == ["count", "half", "count_2"]
    assert rf.last_values == {}
    prompts, completions = ["p"] * 4, ["a", "bb", "", "dddd"]
    total = rf(prompts, completions, update=0)
    # count = [1, 2, 0, 4], half = 0.5: 2 * count - 3 * 0.5 + 0.25 * count
    assert total.dtype == torch.float32 and total.shape == (4,)
    assert total.tolist() == [2.25 - 1.5, 4.5 - 1.5, -1.5, 9.0 - 1.5]
    assert set(rf.last_values) == {"count", "half", "count_2"}
    assert rf.last_values["count"].tolist() == [1.0, 2.0, 0.0, 4.0] == rf.last_values["count_2"].tolist()
    assert rf.last_values["half"].tolist() == [0.5] * 4
    assert all(v.dtype == torch.float32 and v.shape == (4,) for v in rf.last_values.values())
    again, values = rf.compute(prompts, completions, update=1)
    assert torch.equal(again, total) and values.keys() == rf.last_values.keys()
    assert rf([], [], update=2).shape == (0,)


def test_outputs_may_be_tuples_bools_arrays_and_tensors(pkg):
    rf = load_reward_functions([f"{pkg}.fns:Scorer.score", f"{pkg}.fns:tensor_ok"], None)
    assert rf(["p"] * 3, ["a", "b", "c"], update=0).tolist() == [1.0, 2.0, 3.0]
    rf = RewardFunctions([lambda prompts, completions, **kw: (True, False, np.float32(0.5))])
    assert rf(["p"] * 3, ["a", "b", "c"], update=0).tolist() == [1.0, 0.0, 0.5]
    assert rf.specs[0].startswith("test_rewards:") and rf.names == ["<lambda>"]


def test_columns_are_passed_through_by_keyword(pkg):
    records = [{"question": "q0", "history": [], "columns": {"topic": "t0"}}, {"question": "q1", "history": []}]
    columns = reward_columns(records)
    assert columns == {"question": ["q0", "q1"], "system": [None, None], "topic": ["t0", None]}
    rf = load_reward_functions([f"{pkg}.fns:wants_columns"], None)
    assert rf(["p0", "p1"], ["c0", "c1"], update=0, **columns).tolist() == [1.0, 1.0]
    # a function without **kwargs gets only the columns it names
    rf = load_reward_functions([f"{pkg}.fns:named_only"], None)
    assert rf(["p0", "p1"], ["it is t0", "t1"], update=0, question=["q0", "q1"], topic=["t0", "t2"]).tolist() == [
        1.0, 0.0]
    with pytest.raises(ValueError, match=r"^column 'topic' holds 1 values for 2 completions$"):
        rf(["p0", "p1"], ["c0", "c1"], update=0, topic=["t0"])
    with pytest.raises(ValueError, match=r"^1 prompts for 2 completions$"):
        rf(["p0"], ["c0", "c1"], update=0, topic=["t0", "t1"])


def test_functions_cannot_change_what_the_next_one_sees():
    def greedy(prompts, completions, **kw):
        completions.clear()
        kw["question"][0] = "changed"
        return [0.0]

    seen = []

    def honest(prompts, completions, question, **kw):
        seen.append((list(completions), list(question)))
        return [1.0] * len(completions)

    question = ["q"]
    rf = RewardFunctions([greedy, honest], specs=["m:greedy", "m:honest"])
    assert rf(["p"], ["c"], update=0, question=question).tolist() == [1.0]
    assert question == ["q"] and seen == [(["c"], ["q"])]


# every run-time error, exactly, in one line naming the entry and the update
RUN_ERRORS = [
    ("raises_keyerror", "raised KeyError: 'x'"),
    ("raises_multiline", "raised ValueError: bad thing"),
    ("raises_bare", "raised RuntimeError"),
    ("too_few", "returned 3 values for 4 completions"),
    ("scalar", "returned float, not a list of numbers"),
    ("text", "returned str, not a list of numbers"),
    ("nothing", "returned None, not a list of numbers"),
    ("generator", "returned generator, not a list of numbers"),
    ("with_nan", "returned nan at row 1 (rewards must be finite numbers)"),
    ("with_inf", "returned -inf at row 2 (rewards must be finite numbers)"),
    ("with_none", "returned None at row 1 (rewards must be finite numbers)"),
    ("with_string", "returned '0.5' (str) at row 3, not a number"),
    ("with_list", "returned [0.0] (list) at row 0, not a number"),
    ("tensor_2d", "returned a Tensor of shape (4, 1), not a list of numbers"),
]


@pytest.mark.parametrize("name, what", RUN_ERRORS)
def test_run_errors_are_one_line_naming_the_function_and_the_update(pkg, name, what):
    rf = load_reward_functions([f"{pkg}.fns:count", f"{pkg}.fns:{name}"], None)
    with pytest.raises(RewardFunctionError) as err:
        rf(["p"] * 4, ["a", "b", "c", "d"], update=3)
    assert one_line(err) == f"reward function {pkg}.fns:{name} at update 3: {what}"
    assert isinstance(err.value, RuntimeError)
    if name == "raises_keyerror":
        assert isinstance(err.value.__cause__, KeyError)


# ---------------------------------------------------------------------------------------------------------------
# the demo's ground truth as a reward function
# ---------------------------------------------------------------------------------------------------------------
CASES = [
    ("你觉得医院怎么样？", "医院很棒，我很喜欢。"),
    ("你觉得医院怎么样？", "博物馆特别舒服，下次还想再来。"),
    ("咖啡好不好？", "咖啡太差了，劝大家别试。"),
    ("请评价一下这本书。", "这本书还行，一般般。"),
    ("说说你对火锅的看法。", ""),
]


def test_ground_truth_reward_equals_score_response():
    template = Template()
    questions = [q for q, _ in CASES]
    completions = [c for _, c in CASES]
    want = [dt.score_response(q, c) for q, c in CASES]
    assert want == [1.0, -1.0, -1.0, 0.0, -1.0]
    prompts = [template.format_prompt(q) for q in questions]
    assert prompts[0] == "问：你觉得医院怎么样？\n\n答："
    assert dt.ground_truth_reward(prompts, completions) == want  # the question recovered from the prompt
    assert dt.ground_truth_reward(["?"] * 5, completions, question=questions, topic=["x"] * 5) == want  # the column
    # earlier turns naming another topic: the last question counts
    history = [("你觉得咖啡怎么样？", "咖啡很棒，我很喜欢。")]
    prompts = [template.format_prompt(q, history) for q in questions]
    assert dt.ground_truth_reward(prompts, completions) == want
    assert [dt.question_of_prompt(p) for p in prompts] == questions
    assert dt.question_of_prompt("<|im_start|>user\n你喜欢医院吗？<|im_end|>") == "<|im_start|>user\n你喜欢医院吗？<|im_end|>"


def test_ground_truth_reward_through_reward_functions_and_prompt_records(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"instruction": q, "topic": dt.topic_of(q)} for q, _ in CASES])
    records = read_records(DataArguments(dataset_name=path), "prompts")
    columns = reward_columns(records)
    assert columns["question"] == [q for q, _ in CASES]
    assert columns["topic"] == ["医院", "医院", "咖啡", "这本书", "火锅"]
    rf = load_reward_functions([GT], [2.0])
    prompts = [Template().format_prompt(r["question"]) for r in records]
    total = rf(prompts, [c for _, c in CASES], update=0, **columns)
    assert total.tolist() == [2.0, -2.0, -2.0, 0.0, -2.0]
    assert rf.last_values["ground_truth_reward"].tolist() == [1.0, -1.0, -1.0, 0.0, -1.0]
    with pytest.raises(RewardFunctionError) as err:  # a question naming no topic
        rf(["问：你好吗？\n\n答："], ["很好"], update=7)
    assert one_line(err) == (f"reward function {GT} at update 7: raised ValueError: a demo question names exactly one "
                             "topic; '你好吗？' names []")


# ---------------------------------------------------------------------------------------------------------------
# extra columns of prompt records
# ---------------------------------------------------------------------------------------------------------------
def test_prompt_records_carry_extra_scalar_columns(tmp_path):
    rows = [{"instruction": "你觉得咖啡怎么样？", "input": "", "topic": "咖啡", "level": 2, "weight": 0.5, "ok": True,
             "tags": ["a", "b"], "meta": {"k": 1}},
            {"instruction": "公园好不好？", "input": "细说", "topic": None, "level": 3, "weight": 1.5, "ok": False,
             "tags": [], "meta": {"k": 2}}]
    extra = write_jsonl(tmp_path / "extra.jsonl", rows)
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"instruction": "你喜欢医院吗？"}])
    records = read_records(DataArguments(dataset_name=[extra]), "prompts")
    assert records == [
        {"question": "你觉得咖啡怎么样？", "history": [],
         "columns": {"topic": "咖啡", "level": 2, "weight": 0.5, "ok": True}},
        {"question": "公园好不好？\n细说", "history": [],
         "columns": {"topic": None, "level": 3, "weight": 1.5, "ok": False}},
    ]
    assert read_records(DataArguments(dataset_name=plain), "prompts") == [{"question": "你喜欢医院吗？", "history": []}]
    both = read_records(DataArguments(dataset_name=extra, datasets=[{"dataset_name": plain}]), "prompts")
    assert reward_columns(both) == {
        "question": ["你觉得咖啡怎么样？", "公园好不好？\n细说", "你喜欢医院吗？"], "system": [None, None, None],
        "topic": ["咖啡", None, None], "level": [2, 3, None], "weight": [0.5, 1.5, None], "ok": [True, False, None]}


def test_prompt_columns_by_format(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": messages, "id": 7, "answer": "4"}])
    (rec,) = read_records(DataArguments(dataset_name=path), "prompts")
    assert rec == {"question": "2+2?", "history": [], "system": "Be brief.", "columns": {"id": 7, "answer": "4"}}
    assert reward_columns([rec]) == {"question": ["2+2?"], "system": ["Be brief."], "id": [7], "answer": ["4"]}
    hh = {"chosen": "\n\nHuman: Hi\n\nAssistant: Yes", "rejected": "\n\nHuman: Hi\n\nAssistant: No", "src": "hh"}
    (rec,) = read_records(DataArguments(dataset_name=write_jsonl(tmp_path / "hh.jsonl", [hh])), "prompts")
    assert rec["columns"] == {"src": "hh"}  # chosen / rejected hold the prompt: not extras
    sharegpt = {"conversations": [{"from": "human", "value": "Hi"}], "system": "Be kind.", "lang": "en"}
    (rec,) = read_records(DataArguments(dataset_name=write_jsonl(tmp_path / "sg.jsonl", [sharegpt])), "prompts")
    assert rec["columns"] == {"system": "Be kind.", "lang": "en"}
    assert reward_columns([rec]) == {"question": ["Hi"], "system": ["Be kind."], "lang": ["en"]}


def test_reward_columns_shadowed_and_reserved_names_are_warned_once(caplog, monkeypatch):
    monkeypatch.setattr(rw, "_warned", set())
    records = [{"question": "q", "history": [], "columns": {"question": "other", "prompts": "x", "k": 1}}]
    with caplog.at_level(logging.WARNING, logger="rlhf_trl.rewards"):
        assert reward_columns(records) == {"question": ["q"], "system": [None], "k": [1]}
        reward_columns(records)
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "the data column 'question' is not passed to reward functions: 'question' is the normalised question",
        "the data column 'prompts' is not passed to reward functions: it is an argument of the call; rename the "
        "column"]


def test_module_docstring_example_runs():
    doc = rw.__doc__
    start = doc.index("    def mentions_topic")
    source = textwrap.dedent(doc[start:doc.index("Units:")])
    space: dict = {}
    exec(source, space)
    rf = RewardFunctions([space["mentions_topic"]])
    assert rf(["p", "p"], ["咖啡很棒", "很棒"], update=0, topic=["咖啡", "咖啡"], question=["a", "b"]).tolist() == [
        1.0, 0.0]
    assert math.isclose(float(rf.last_values["mentions_topic"].sum()), 1.0)
