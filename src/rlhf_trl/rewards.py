"""Reward functions for PPO: plain Python scorers of decoded completions, named in the recipe (``reward_funcs:
["rlhf_trl.demo_task:ground_truth_reward", "my_rewards.py:length_penalty"]``, optional ``reward_weights: [1.0, 0.1]``,
default 1.0 each). Each entry is ``"package.module:function"`` (imported) or ``"path/to/file.py:function"`` (relative to
the current directory, not put on ``sys.path``); ``function`` may be dotted (``module:Class.method``). Calling
convention (TRL GRPO's), all by keyword: ``f(prompts=..., completions=..., **columns)``, ``prompts`` / ``completions``
being ``[batch]`` prompt texts / decoded responses (no EOS) and ``columns`` one ``[batch]`` list per column
(`reward_columns`; a function without ``**kwargs`` gets only those it names); it returns ``[batch]`` finite numbers
(a list, tuple, 1-D array or tensor; bools count as 0 / 1). E.g. (``reward_funcs: ["my_rewards.py:mentions_topic"]``)::

    def mentions_topic(prompts, completions, topic, **kwargs):
        return [1.0 if t in c else 0.0 for c, t in zip(completions, topic)]

Units: reward units. A completion's score is ``sum_i reward_weights[i] * f_i``, plus ``rm_score - reward_baseline``
with a reward model (weights: RM units per unit of each function), before PPO's reward shaping. Errors are one line:
`ValueError` while loading (naming the recipe key and entry), `RewardFunctionError` in the run."""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import logging
import math
import numbers
import os
import re
import sys
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

FORMS = "'package.module:function' or 'path/to/file.py:function'"
RESERVED = ("prompts", "completions")  # keyword arguments of the call: never passed as columns
_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_warned: set[str] = set()


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned no ``[batch]`` finite numbers (one line: the entry and the update)."""


class RewardFunctions:
    """Reward functions with one finite weight each (None: 1.0 each); calling it scores a batch of completions.
    ``specs``: the recipe entries (default ``module:qualname``); ``names``: unique short names for
    ``objective/reward_fn/<name>``; ``last_values``: name -> the last call's unweighted ``[batch]`` float32 values.
    Raises `ValueError` (one line): no function, bad weights, a function without ``prompts`` / ``completions``."""

    def __init__(self, functions: Sequence[Callable], weights: Sequence[float] | None = None,
                 specs: Sequence[str] | None = None):
        if not functions:
            raise ValueError("reward_funcs: no reward function given")
        self.functions = list(functions)
        if specs is not None and len(specs) != len(self.functions):
            raise ValueError(f"reward_funcs: {len(specs)} entries for {len(self.functions)} functions")
        self.specs = list(specs) if specs is not None else [
            f"{getattr(f, '__module__', '?')}:{getattr(f, '__qualname__', type(f).__name__)}" for f in functions]
        self.weights = _check_weights(weights, self.specs)
        self._keywords = [_keywords(fn) for fn in self.functions]
        for i, (spec, keywords) in enumerate(zip(self.specs, self._keywords)):
            if missing := [k for k in RESERVED if keywords is not None and k not in keywords]:
                raise ValueError(f"reward_funcs[{i}] {spec!r}: takes no {' / '.join(map(repr, missing))} argument; a "
                                 "reward function is f(prompts, completions, **columns) -> list[float]")
        self.names: list[str] = []
        for spec in self.specs:  # unique short names: the function's, then name_2, name_3 ...
            base = spec.rpartition(":")[2].rpartition(".")[2] or spec
            self.names.append(next(name for k in itertools.count(1)
                                   if (name := base if k == 1 else f"{base}_{k}") not in self.names))
        self.last_values: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.functions)

    def __repr__(self) -> str:
        return "RewardFunctions(" + ", ".join(f"{s} x {w:g}" for s, w in zip(self.specs, self.weights)) + ")"

    def __call__(self, prompts: list[str], completions: list[str], update: int, **columns) -> torch.Tensor:
        """`compute`'s weighted sum, ``[batch]`` float32 (CPU, reward units); stores the values in `last_values`."""
        total, self.last_values = self.compute(prompts, completions, update, **columns)
        return total

    def compute(self, prompts: list[str], completions: list[str], update: int,
                **columns) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Score ``[batch]`` prompts and completions with ``columns`` (`reward_columns`): ``(total, values)`` on CPU,
        ``total`` ``[batch]`` float32 ``sum_i weights[i] * f_i`` (float64 sum), ``values`` name -> unweighted float32.
        Raises `RewardFunctionError`: a function raised or returned bad values; `ValueError`: lengths differ."""
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"{len(prompts)} prompts for {n} completions")
        for key, column in columns.items():
            if len(column) != n:
                raise ValueError(f"column {key!r} holds {len(column)} values for {n} completions")
        rows = []
        for spec, fn, keywords in zip(self.specs, self.functions, self._keywords):
            kwargs = {k: list(v) for k, v in columns.items() if keywords is None or k in keywords}
            try:  # copies: a function that edits its arguments in place cannot change what the next one sees
                out = fn(prompts=list(prompts), completions=list(completions), **kwargs)
            except Exception as exc:
                raise RewardFunctionError(f"reward function {spec} at update {update}: raised {_one_line(exc)}"
                                          ) from exc
            rows.append(_check_output(out, n, spec, update))
        values = torch.tensor(rows, dtype=torch.float64).reshape(len(rows), n)  # [n_functions, batch]
        total = (torch.tensor(self.weights, dtype=torch.float64)[:, None] * values).sum(0)
        return total.float(), {name: values[k].float() for k, name in enumerate(self.names)}


def load_reward_functions(specs: list[str] | None, weights: list[float] | None = None) -> RewardFunctions | None:
    """The recipe's ``reward_funcs`` (a string: a list of one) and ``reward_weights`` (None or ``[]``: 1.0 each) as
    `RewardFunctions`; None without ``specs``. Raises `ValueError` (one line, naming the key and the entry): a bad entry
    or weights, a failed import (with the root cause), no such callable, no ``prompts`` / ``completions``."""
    specs = [specs] if isinstance(specs, str) else list(specs or [])
    weights = [weights] if isinstance(weights, numbers.Real) else (list(weights) if weights else None)
    if not specs:
        if weights:
            raise ValueError(f"reward_weights: {len(weights)} weight(s) but no reward_funcs")
        return None
    for i, spec in enumerate(specs):  # cheap checks first: nothing is imported yet
        module, sep, attr = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
        if not sep or not module or not _MODULE.match(attr) or not (module.endswith(".py") or _MODULE.match(module)):
            raise ValueError(f"reward_funcs[{i}]: {spec!r} is not {FORMS}")
    _check_weights(weights, specs)
    functions = [_resolve(i, spec, *spec.rpartition(":")[::2]) for i, spec in enumerate(specs)]
    rf = RewardFunctions(functions, weights, specs)
    logger.info("reward functions: %s", rf)
    return rf


def reward_columns(records: list[dict]) -> dict[str, list]:
    """The keyword columns of reward functions for prompt records (one per completion), name -> ``[batch]`` list:
    ``question``, ``system`` (the record's, else its ``system`` column, else None), then each extra column (in order of
    first appearance; None where missing) but ``question``, ``prompts`` and ``completions`` (a warning, once each)."""
    extras = [r.get("columns") or {} for r in records]
    out: dict[str, list] = {"question": [r["question"] for r in records], "system": [
        r["system"] if r.get("system") is not None else e.get("system") for r, e in zip(records, extras)]}
    for name in dict.fromkeys(k for e in extras for k in e if k != "system"):
        if name != "question" and name not in RESERVED:
            out[name] = [e.get(name) for e in extras]
        elif name not in _warned:
            _warned.add(name)
            logger.warning("the data column %r is not passed to reward functions: %s", name,
                           "'question' is the normalised question" if name == "question"
                           else "it is an argument of the call; rename the column")
    return out


def _check_weights(weights, specs: Sequence[str]) -> list[float]:
    if weights is None:
        return [1.0] * len(specs)
    weights = list(weights)
    if len(weights) != len(specs):
        raise ValueError(f"reward_weights: {len(weights)} weight(s) for {len(specs)} reward_funcs (one per function, "
                         "in order)")
    for j, (w, spec) in enumerate(zip(weights, specs)):
        if isinstance(w, bool) or not isinstance(w, numbers.Real):
            raise ValueError(f"reward_weights[{j}]: {w!r} (for {spec!r}) is not a number")
        if not math.isfinite(w):
            raise ValueError(f"reward_weights[{j}]: {w!r} (for {spec!r}) is not finite")
    return [float(w) for w in weights]


def _resolve(i: int, spec: str, module_name: str, attr: str) -> Callable:
    where = f"reward_funcs[{i}] {spec!r}"
    if module_name.endswith(".py"):
        module, owner = _import_file(where, module_name), f"file {module_name!r}"
    else:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            local = module_name.replace(".", os.sep) + ".py"
            hint = (f" (a local file: write '{local}:{attr}')"
                    if isinstance(exc, ModuleNotFoundError) and os.path.isfile(local) else "")
            cause = _one_line(exc, root=True)
            raise ValueError(f"{where}: cannot import module {module_name!r}: {cause}{hint}") from None
        owner = f"module {module_name!r}"
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{where}: {owner} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{where}: {attr!r} is a {type(obj).__name__}, not callable")
    return obj


def _import_file(where: str, path: str):
    """Import a local ``.py`` file (relative to the current directory) as a module of its own, once per file."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise ValueError(f"{where}: file not found: {full}")
    name = "_rlhf_trl_reward_" + re.sub(r"\W", "_", full)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it, as import does (dataclasses, pickling look it up)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ValueError(f"{where}: cannot import file {full}: {_one_line(exc, root=True)}") from None
    return module


def _keywords(fn: Callable) -> frozenset[str] | None:
    """The keyword arguments ``fn`` accepts, or None when it takes ``**kwargs`` (or has no readable signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return None if any(p.kind is p.VAR_KEYWORD for p in params) else frozenset(
        p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def _one_line(exc: BaseException, root: bool = False) -> str:
    """``Type: message`` of ``exc`` (``root``: of its innermost cause), whitespace collapsed."""
    while root and (exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__)):
        exc = exc.__cause__ or exc.__context__
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _check_output(out, n: int, spec: str, update: int) -> list[float]:
    """``out`` as ``n`` floats; RewardFunctionError for anything but a 1-D sequence of ``n`` finite numbers."""
    head, kind = f"reward function {spec} at update {update}: returned", "None" if out is None else type(out).__name__
    if hasattr(out, "tolist") and not isinstance(out, (list, tuple)):  # torch / numpy arrays and scalars
        if getattr(out, "ndim", 1) != 1:
            raise RewardFunctionError(f"{head} a {kind} of shape {tuple(out.shape)}, not a list of numbers")
        out = out.tolist()
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
        raise RewardFunctionError(f"{head} {kind}, not a list of numbers")
    if len(out) != n:
        raise RewardFunctionError(f"{head} {len(out)} values for {n} completions")
    values = []
    for j, x in enumerate(out):
        try:
            if isinstance(x, (str, bytes)):
                raise TypeError
            v = None if x is None else float(x)
        except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several elements
            text = " ".join(repr(x).split())  # on one line, at most 60 characters
            text = text if len(text) <= 60 else text[:57] + "..."
            raise RewardFunctionError(f"{head} {text} ({type(x).__name__}) at row {j}, not a number") from None
        if v is None or not math.isfinite(v):
            raise RewardFunctionError(f"{head} {v} at row {j} (rewards must be finite numbers)")
        values.append(v)
    return values
