"""Bit-exact comparison of two finished runs of a stage, and a fork server that runs stages in fresh processes.

`assert_runs_equal(dir_a, dir_b)` holds a resumed (or killed and resumed) run to the uninterrupted one: every file
both runs left is compared by what it holds, tensors with `torch.equal` (bit for bit: a NaN equals a NaN of the same
bits), everything else with ``==`` (a float NaN equals NaN). Compared:

- final weights: every ``*.safetensors`` outside the checkpoints (``merged/``, ``adapter/``, PPO's ``value_model/``);
- every checkpoint both runs hold (the newest must be one): weights, ``optimizer.pt``, ``scheduler.pt``, the RNG
  states (``rng_state*.pth``), PPO's data position (``data_state*.pt``), PPO's reward baseline and KL coefficient
  (``reward_baseline.json``: ``reward_baseline``, ``kl_coef``), SFT / RM loop sums (``loop_state.json``), and
  ``trainer_state.json`` (log history included);
- the run's ``log_history.json``, ``metrics.json`` (PPO: ``kl_coef_final``), RM ``eval_metrics.json`` /
  ``eval_pairs.jsonl``, PPO ``samples.jsonl``, ``run_config.yaml``.

Left out, by name: `WALL_TIME_FIELDS` in any log entry or metrics file, `PATH_KEYS` of the recipe files (the two
runs write to different directories), ``training_args.bin`` (a pickle of the arguments, paths included; its values
are ``run_config.yaml``'s) and ``runs/`` (TensorBoard event files: wall-clock stamps); the order of `SET_VALUED`
lists in ``adapter_config.json`` (peft writes these sets in the string-hash order of the process); the file sizes in
a checkpoint's ``manifest.json`` (its list of files is compared): besides the files holding paths or wall times,
a pickle's bytes depend on which equal objects it shares (a resumed run's PPO ``data_state.pt`` holds a saved RNG
state next to a fresh one and is 64 bytes longer than the uninterrupted run's, with the same values).

`Zygote`: a process that imports torch, transformers, TRL and the stages once, then forks a child per request to
run a stage (``rlhf-trl <stage> ARGS``) with extra environment variables, and reports how the child ended
(``returncode``: exit status, or minus the signal that killed it, as `subprocess` does). Each child is a fresh
process as far as the run is concerned (nothing ran in the zygote but imports); it saves the seconds of importing.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml

# measured from elapsed time: differ between two runs of the same computation
WALL_TIME_FIELDS = frozenset({
    "eps",  # PPO: episodes per second since the start of this process's training
    "train_runtime", "train_samples_per_second", "train_steps_per_second", "train_tokens_per_second",
    "eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_tokens_per_second",
    "peak_memory_mb",  # the process's peak memory: a resumed process has a different history
    "step_time",  # GRPO / RLOO: seconds per step
})
# recipe keys naming where a run writes (differ between the runs compared)
PATH_KEYS = frozenset({"output_dir", "logging_dir", "resume_from_checkpoint"})
NOT_COMPARED = frozenset({"training_args.bin", ".rlhf-trl.lock"})  # the lock names its holder: not run state
SET_VALUED = ("target_modules", "modules_to_save")  # adapter_config.json: sets, compared as sets
SKIPPED_DIRS = frozenset({"runs"})
CHECKPOINT = re.compile(r"checkpoint-(\d+)$")


# -- equality ------------------------------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def assert_same(a, b, where: str = "") -> None:
    """``a`` and ``b`` hold the same values: tensors `torch.equal` (or the same bits), numpy arrays equal, floats ==
    (NaN == NaN), mappings and sequences element by element. AssertionError names the first difference."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{where}: {type(a)} vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if torch.equal(a, b) or torch.equal(_bits(a), _bits(b)):
            return
        diff = (a.double() - b.double()).abs().nan_to_num(float("inf")).max().item() if a.is_floating_point() else "-"
        raise AssertionError(f"{where}: tensors differ (max abs difference {diff})")
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), f"{where}: {type(a)} vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"), f"{where}: arrays differ"
        return
    if isinstance(a, dict):
        assert isinstance(b, dict), f"{where}: dict vs {type(b)}"
        assert set(a) == set(b), f"{where}: keys only in a {sorted(map(str, set(a) - set(b)))}, only in b " \
                                 f"{sorted(map(str, set(b) - set(a)))}"
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
        return
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return
    assert type(a) is type(b) and a == b, f"{where}: {a!r} vs {b!r}"


def drop_wall_time(entries):
    """A log entry (or a list of them, or metrics) without `WALL_TIME_FIELDS`."""
    if isinstance(entries, list):
        return [drop_wall_time(e) for e in entries]
    return {k: v for k, v in entries.items() if k not in WALL_TIME_FIELDS}


# -- reading a file for comparison ---------------------------------------------------------------------------------
def _load_jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def comparable(path: Path):
    """What of a run's file is compared (see the module docstring)."""
    name = path.name
    if name.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(str(path))
    if name.endswith((".pt", ".pth")):
        return torch.load(path, weights_only=False)
    if name == "trainer_state.json":
        state = json.loads(path.read_text(encoding="utf-8"))
        state["log_history"] = drop_wall_time(state["log_history"])
        return state
    if name in ("log_history.json",):
        data = json.loads(path.read_text(encoding="utf-8"))
        return {"log_history": drop_wall_time(data["log_history"])}
    if name == "metrics.json":
        return drop_wall_time(json.loads(path.read_text(encoding="utf-8")))
    if name == "manifest.json":  # the files it lists (their sizes: see the module docstring)
        data = json.loads(path.read_text(encoding="utf-8"))
        data["files"] = sorted(data["files"])
        return data
    if name == "adapter_config.json":  # peft writes target_modules, a set, in the process's string-hash order
        data = json.loads(path.read_text(encoding="utf-8"))
        for key in SET_VALUED:
            if isinstance(data.get(key), list):
                data[key] = sorted(data[key])
        return data
    if name.endswith(".json"):
        return json.loads(path.read_text(encoding="utf-8"))
    if name.endswith(".jsonl"):
        return _load_jsonl(path)
    if name.endswith((".yaml", ".yml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        return {k: v for k, v in data.items() if k not in PATH_KEYS} if isinstance(data, dict) else data
    return path.read_bytes()


def run_files(root: Path) -> dict[str, Path]:
    """The files of a finished run that are compared, by path relative to ``root`` (staging directories, ``runs/``
    and `NOT_COMPARED` left out)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        rel_folder = Path(folder).relative_to(root)
        dirs[:] = [d for d in dirs if not d.startswith(".tmp-") and not (rel_folder == Path(".") and d in SKIPPED_DIRS)]
        for f in files:
            if f in NOT_COMPARED or f.endswith(".tmp"):
                continue
            found[str(rel_folder / f)] = Path(folder) / f
    return found


def checkpoints(root) -> list[int]:
    """Steps of the complete ``checkpoint-N`` directories in ``root``, ascending."""
    return sorted(int(m.group(1)) for d in os.listdir(root) if (m := CHECKPOINT.match(d)))


def assert_trees_equal(dir_a, dir_b, rel: str = "") -> None:
    """Every compared file (`run_files`) under ``dir_a/rel`` and ``dir_b/rel`` holds the same (`comparable`)."""
    a, b = Path(dir_a) / rel, Path(dir_b) / rel
    fa, fb = run_files(a), run_files(b)
    assert set(fa) == set(fb), f"only in {a}: {sorted(set(fa) - set(fb))}; only in {b}: {sorted(set(fb) - set(fa))}"
    for name in sorted(fa):
        assert_same(comparable(fa[name]), comparable(fb[name]), os.path.join(rel, name))


def assert_runs_equal(dir_a, dir_b) -> None:
    """The finished runs in ``dir_a`` and ``dir_b`` hold the same results (module docstring). Checkpoints that only
    one of them holds (a resumed run lacks those it did not copy) are not compared; the newest must be in both."""
    a, b = Path(dir_a), Path(dir_b)
    ca, cb = checkpoints(a), checkpoints(b)
    assert ca and cb and ca[-1] == cb[-1], f"newest checkpoints differ: {ca} vs {cb}"
    common = set(ca) & set(cb)
    fa, fb = run_files(a), run_files(b)

    def keep(rel: str) -> bool:
        m = CHECKPOINT.match(rel.split(os.sep)[0])
        return m is None or int(m.group(1)) in common

    fa = {k: v for k, v in fa.items() if keep(k)}
    fb = {k: v for k, v in fb.items() if keep(k)}
    assert set(fa) == set(fb), f"files only in {a}: {sorted(set(fa) - set(fb))}; only in {b}: {sorted(set(fb) - set(fa))}"
    weights = [k for k in fa if k.endswith(".safetensors") and not CHECKPOINT.match(k.split(os.sep)[0])]
    assert weights, f"{a} holds no final weights"
    for rel in sorted(fa):
        assert_same(comparable(fa[rel]), comparable(fb[rel]), rel)


# -- the configurations held to exact resume ----------------------------------------------------------------------
RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "demo"
MULTI_CPU = Path(__file__).resolve().parents[1] / "recipes" / "accelerate_configs" / "multi_cpu.yaml"


class StageConfig:
    """One run held to exact resume: ``rlhf-trl <stage> argv --output_dir DIR`` on ``nproc`` processes; its
    uninterrupted run saves ``checkpoints`` (steps), the last one at the end of training."""

    def __init__(self, name: str, stage: str, argv: list[str], checkpoints: list[int], nproc: int = 1):
        self.name, self.stage, self.argv, self.checkpoints, self.nproc = name, stage, argv, checkpoints, nproc

    def __repr__(self) -> str:
        return f"StageConfig({self.name})"


def stage_configs(assets: dict, sft_merged: str, rm_merged: str) -> dict[str, StageConfig]:
    """The eleven configurations: tiny runs of the demo assets, three checkpoints each, the second in the middle of
    the run. SFT / RM: 8 steps of 2 accumulated micro-batches, 2 passes over the data, checkpoints between two
    logging steps (so the loop's running loss sums matter). PPO: 3 updates, adaptive KL control, a sample table
    every update, the 2nd checkpoint at the end of a pass over the prompts (2 processes: in the second pass)."""
    common = ["--save_strategy", "steps", "--report_to", "none", "--overwrite_output_dir", "true"]
    sft = ["--config", f"{RECIPES}/sft.yaml", "--dataset_name", assets["sft"], "--model_name_or_path",
           assets["base_model"], "--max_samples", "36", "--eval_split_size", "4", "--num_train_epochs", "2",
           "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--warmup_steps", "2",
           "--save_steps", "3", "--logging_steps", "2", *common]  # 32 rows / 8 = 4 steps a pass, 8 steps
    rm = ["--config", f"{RECIPES}/rm.yaml", "--dataset_name", assets["rm"], "--model_name_or_path", sft_merged,
          "--max_samples", "12", "--eval_split_size", "4", "--num_train_epochs", "2",
          "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--save_steps", "3",
          "--logging_steps", "2", *common]  # 36 pairs - 4 held out = 32 / 8 = 4 steps a pass, 8 steps
    ppo = ["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"], "--sft_model_path", sft_merged,
           "--reward_model_path", rm_merged, "--max_samples", "24", "--eval_split_size", "8",
           "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--per_device_eval_batch_size",
           "4", "--total_episodes", "24", "--num_ppo_epochs", "1", "--response_length", "8",
           "--local_rollout_forward_batch_size", "8", "--kl_target", "0.5", "--kl_horizon", "40",
           "--log_samples_every", "1", "--save_steps", "1", "--logging_steps", "1", *common]
    # 16 prompts / 8 = 2 updates a pass, 3 updates: checkpoint-2 ends the first pass
    ppo2 = [*ppo]
    ppo2[ppo2.index("--max_samples") + 1] = "32"
    ppo2[ppo2.index("--eval_split_size") + 1] = "16"
    ppo2[ppo2.index("--total_episodes") + 1] = "48"
    # 2 processes: 16 prompts / 16 = 1 update a pass, 3 updates: checkpoint-2 is in the second pass (the sampler's
    # generator, shared by the processes, has moved on)
    dpo = ["--config", f"{RECIPES}/dpo.yaml", "--dataset_name", assets["rm"], "--model_name_or_path", sft_merged,
           "--max_samples", "12", "--eval_split_size", "4", "--num_train_epochs", "2", "--per_device_train_batch_size",
           "4", "--gradient_accumulation_steps", "2", "--save_steps", "3", "--logging_steps", "2", *common]
    # 36 pairs - 4 held out = 32 / 8 = 4 steps a pass, 8 steps (as RM)
    grpo = ["--config", f"{RECIPES}/grpo.yaml", "--dataset_name", assets["prompts"], "--model_name_or_path",
            sft_merged, "--reward_model_path", rm_merged, "--max_samples", "16", "--eval_split_size", "4",
            "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "8",
            "--max_steps", "6", "--save_steps", "2", "--logging_steps", "1", *common]
    # 2 prompts x 4 completions a step; 12 training prompts / 2 = 6 steps: one pass
    rloo = [*grpo]
    rloo[rloo.index(f"{RECIPES}/grpo.yaml")] = f"{RECIPES}/rloo.yaml"
    kto = ["--config", f"{RECIPES}/kto.yaml", "--dataset_name", assets["rm"], "--model_name_or_path", sft_merged,
           "--max_samples", "6", "--eval_split_size", "4", "--num_train_epochs", "2", "--per_device_train_batch_size",
           "4", "--gradient_accumulation_steps", "2", "--save_steps", "3", "--logging_steps", "2", *common]
    # 6 ranked lists x 3 pairs x 2 examples = 36 - 4 held out = 32 / 8 = 4 steps a pass, 8 steps (as DPO)
    lora_value = ["--value_use_peft", "true", "--value_lora_r", "4"]
    configs = [
        StageConfig("sft", "sft", sft, [3, 6, 8]),
        StageConfig("rm", "rm", rm, [3, 6, 8]),
        StageConfig("ppo", "ppo", ppo, [1, 2, 3]),
        StageConfig("ppo_value_lora", "ppo", [*ppo, *lora_value], [1, 2, 3]),
        StageConfig("ppo_shared_base", "ppo", [*ppo, *lora_value, "--share_reward_value_base", "true"], [1, 2, 3]),
        StageConfig("ppo_baseline_auto", "ppo", [*ppo, "--reward_baseline", "auto", "--reward_baseline_batches", "1"],
                    [1, 2, 3]),
        StageConfig("ppo_2proc", "ppo", ppo2, [1, 2, 3], nproc=2),
        StageConfig("dpo", "dpo", dpo, [3, 6, 8]),
        StageConfig("grpo", "grpo", grpo, [2, 4, 6]),
        StageConfig("rloo", "rloo", rloo, [2, 4, 6]),
        StageConfig("kto", "kto", kto, [3, 6, 8]),
    ]
    return {c.name: c for c in configs}


def small_models(zygote: "Zygote", assets: dict, workdir) -> tuple[str, str]:
    """``(sft_merged, rm_merged)``: a quick SFT (1 pass over 200 rows) and reward model (1 pass over 120 pairs) of
    the demo assets, the inputs of the RM and PPO configurations (any trained models do)."""
    workdir = Path(workdir)
    log = str(workdir / "small_models.log")
    common = ["--num_train_epochs", "1", "--report_to", "none", "--save_strategy", "no"]
    code = zygote.run("sft", ["--config", f"{RECIPES}/sft.yaml", "--dataset_name", assets["sft"], "--model_name_or_path",
                              assets["base_model"], "--max_samples", "200", "--output_dir", str(workdir / "sft"),
                              *common], log)
    assert code == 0, tail(log)
    code = zygote.run("rm", ["--config", f"{RECIPES}/rm.yaml", "--dataset_name", assets["rm"], "--model_name_or_path",
                             str(workdir / "sft" / "merged"), "--max_samples", "40", "--output_dir",
                             str(workdir / "rm"), *common], log)
    assert code == 0, tail(log)
    return str(workdir / "sft" / "merged"), str(workdir / "rm" / "merged")


def accelerate_launch(stage: str, argv: list[str], nproc: int, log: str, env: dict | None = None,
                      timeout: float = 600) -> int:
    """``accelerate launch --config_file multi_cpu.yaml --num_processes nproc -m rlhf_trl.cli stage argv`` (as
    ``make <stage> ACCEL=multi_cpu NPROC=nproc``); output to ``log``; returns the launcher's exit status."""
    full = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
            and not k.startswith("RLHF_TRL_FAULT")}
    full.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                RLHF_TRL_DEBUG="1", PYTHONUNBUFFERED="1", ACCELERATE_USE_CPU="true")
    full["PYTHONPATH"] = os.pathsep.join(p for p in (source_dir(), full.get("PYTHONPATH")) if p)
    full.update(env or {})
    cmd = [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--config_file", str(MULTI_CPU),
           "--num_processes", str(nproc), "--main_process_port", str(free_port()), "-m", "rlhf_trl.cli", stage, *argv]
    with open(log, "ab") as f:
        return subprocess.run(cmd, cwd=REPO, env=full, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode


# -- on-disk state -------------------------------------------------------------------------------------------------
def tree_digest(root) -> str:
    """sha256 over every file under ``root`` outside ``.tmp-*`` staging directories (which a new run removes before
    anything else): relative path and bytes. Two roots with the same digest resume identically."""
    h = hashlib.sha256()
    root = Path(root)
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".tmp-")]
        paths += [Path(folder) / f for f in files]
        paths += [Path(folder) / d for d in dirs]  # empty directories count too
    for p in sorted(paths):
        h.update(str(p.relative_to(root)).encode() + b"\0")
        if p.is_symlink():
            h.update(b"link:" + os.readlink(p).encode())
        elif p.is_file():
            h.update(b"file:" + p.read_bytes())
        else:
            h.update(b"dir")
        h.update(b"\0")
    return h.hexdigest()


# -- the fork server -----------------------------------------------------------------------------------------------
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def source_dir() -> str:
    """The directory holding the ``rlhf_trl`` package this process imports (children run the same code)."""
    import rlhf_trl

    return str(Path(rlhf_trl.__file__).resolve().parents[1])


def _zygote_main() -> None:  # pragma: no cover (runs in the zygote process)
    """Import what the stages need, then serve requests from stdin, one JSON object a line:
    ``{"stage", "argv", "env", "log"}`` -> fork a child that runs ``rlhf-trl <stage> argv`` with ``env`` added
    (keys whose value is None removed), stdout and stderr to ``log``; answer ``{"pid"}`` at once and
    ``{"returncode"}`` when it ends. Answers are lines ``ZYGOTE <json>`` on stdout."""
    import logging  # noqa: F401

    import transformers  # noqa: F401
    import trl  # noqa: F401
    from peft import get_peft_model  # noqa: F401

    from rlhf_trl import cli, ppo, rm, sft  # noqa: F401
    import faults  # tests/fault_hooks (on PYTHONPATH): inert until a request's environment asks for a fault

    faults.install()

    out = os.fdopen(os.dup(1), "w", buffering=1)

    def answer(obj):
        out.write("ZYGOTE " + json.dumps(obj) + "\n")
        out.flush()

    answer({"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                for k, v in req.get("env", {}).items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
                if req.get("sweep"):
                    _install_sweep(req["sweep"])
                if req.get("signals"):
                    _install_signals(req["signals"])
                try:
                    code = cli.main([req["stage"], *req["argv"]]) or 0
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 1
                except BaseException:
                    import traceback

                    traceback.print_exc()
                    code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        answer({"returncode": -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)})


class Zygote:
    """Client of `_zygote_main` (see the module docstring). ``env`` is the zygote's environment (the children get
    it plus each request's ``env``)."""

    def __init__(self, env: dict | None = None):
        base = {k: v for k, v in os.environ.items() if not k.startswith("RLHF_TRL_FAULT")}
        base.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                    PYTHONUNBUFFERED="1", RLHF_TRL_DEBUG="1")
        base["PYTHONPATH"] = os.pathsep.join(p for p in (source_dir(), str(TESTS), base.get("PYTHONPATH")) if p)
        base.update(env or {})
        self.proc = subprocess.Popen([sys.executable, "-c", "import exactness; exactness._zygote_main()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=base, cwd=REPO, bufsize=0)
        self._buf = b""
        self._read(600)  # ready

    def _line(self) -> dict | None:
        """The next complete answer already received, or None."""
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            if line.startswith(b"ZYGOTE "):
                return json.loads(line[len(b"ZYGOTE "):])
        return None

    def poll(self) -> dict | None:
        """An answer if one has arrived, without waiting."""
        answer = self._line()
        if answer is None and select.select([self.proc.stdout], [], [], 0)[0]:
            self._fill()
            answer = self._line()
        return answer

    def _fill(self) -> None:
        chunk = os.read(self.proc.stdout.fileno(), 65536)
        if not chunk:
            raise RuntimeError(f"the zygote ended (status {self.proc.wait()})")
        self._buf += chunk

    def _read(self, timeout: float) -> dict:
        deadline = time.time() + timeout
        while True:
            answer = self._line()
            if answer is not None:
                return answer
            left = deadline - time.time()
            if left <= 0:
                raise TimeoutError("no answer from the zygote")
            if select.select([self.proc.stdout], [], [], left)[0]:
                self._fill()

    def start(self, stage: str, argv: list[str], log: str, env: dict | None = None, sweep: dict | None = None,
              signals: dict | None = None) -> int:
        """Fork a child running the stage; returns its pid (then call `wait`). ``sweep``: see `_install_sweep`;
        ``signals``: see `_install_signals`."""
        req = {"stage": stage, "argv": argv, "env": env or {}, "log": log, "sweep": sweep, "signals": signals}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        return self._read(60)["pid"]

    def wait(self, pid: int, timeout: float = 600) -> int:
        """The child's returncode (``-9``: SIGKILL). A child still running after ``timeout`` s is killed and
        TimeoutError raised."""
        try:
            return self._read(timeout)["returncode"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._read(60)
            raise

    def run(self, stage: str, argv: list[str], log: str, env: dict | None = None, sweep: dict | None = None,
            timeout: float = 600, signals: dict | None = None) -> int:
        return self.wait(self.start(stage, argv, log, env, sweep, signals), timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def tail(path, n: int = 4000) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")[-n:]
    except OSError:
        return ""


# -- kill sweeps: every file operation of one checkpoint save ------------------------------------------------------
SURVIVED = 86  # exit status of a sweep child whose save returned (no fault fired)
_KEEP: list = []  # process groups inherited over fork: never destroyed (their threads did not survive the fork)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_file(path: Path, timeout: float = 300) -> str:
    deadline = time.time() + timeout
    while not path.exists():
        if time.time() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)
    time.sleep(0.005)
    return path.read_text()


def _write_file(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(text)
    os.replace(tmp, path)


def _rejoin_process_group(port: int, rank: int, world: int) -> None:  # pragma: no cover (sweep children)
    """In a child forked from a process of a gloo group: forget the inherited group (its worker threads stayed in
    the parent; the objects are kept alive, never shut down) and join a new one of the children at ``port``."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    w = c10d._world
    _KEEP.append((w.default_pg, dict(w.pg_map), dict(w.pg_names)))
    c10d._update_default_pg(None)
    for table in (w.pg_map, w.pg_names, w.pg_group_ranks, w.pg_backend_config, w.pg_to_tag, w.tags_to_pg,
                  w.pg_coalesce_state):
        table.clear()
    c10d._unregister_all_process_groups()
    w.group_count = 0
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))


def _install_sweep(spec: dict) -> None:  # pragma: no cover (runs in a zygote child)
    """Make this run, at its ``spec["save"]``-th checkpoint save, fork one child per ``spec["points"]`` entry
    ``[op, action]`` that does the save with ``RLHF_TRL_FAULT=<save>:<op>:<action>`` (so it dies there), instead of
    saving itself. Process 0 records after each child how it ended and the digest of the output directory
    (`tree_digest`), keeps one copy of each distinct tree under ``spec["workdir"]/states/<digest>``, puts the
    directory back as it was before the save, and at the end writes ``results.json``; then the run exits (status
    0). Needs ``RLHF_TRL_FAULT_LOG`` set from the start, so the run counts its saves as the children will.

    Under several processes each process forks its child per point; the children form a new gloo group (process 0
    picks the port), process 0's child dies at the fault, and the others' children are then killed as a launcher
    kills the rest of a failed launch. The processes take turns through files in the work directory.
    """
    import shutil

    from rlhf_trl import checkpoints

    original = checkpoints.AtomicCheckpointMixin._save_checkpoint
    calls = [0]

    def patched(self, model, trial):
        calls[0] += 1
        if calls[0] != spec["save"]:
            return original(self, model, trial)
        rank = int(os.environ.get("RANK", "0") or 0)
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        out, work = Path(self.args.output_dir), Path(spec["workdir"])
        pristine = work / "pristine"
        if rank == 0:
            shutil.copytree(out, pristine, symlinks=True)
        results = []
        for i, (op, action) in enumerate(spec["points"]):
            port = 0
            if world > 1:
                if rank == 0:
                    port = free_port()
                    _write_file(work / f"port-{i}", str(port))
                else:
                    port = int(_wait_file(work / f"port-{i}"))
            python_rng = random.getstate()
            pid = os.fork()
            if pid == 0:
                code = SURVIVED
                try:
                    random.setstate(python_rng)  # `random` reseeds itself in a forked child; the save records it
                    os.environ["RLHF_TRL_FAULT"] = f"{spec['save']}:{op}:{action}"
                    os.environ.pop("RLHF_TRL_FAULT_LOG", None)
                    if world > 1:
                        _rejoin_process_group(port, rank, world)
                    original(self, model, trial)
                except BaseException:
                    import traceback

                    traceback.print_exc()
                    code = 1
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            if rank == 0:
                _, status = os.waitpid(pid, 0)
                rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                others = []
                if world > 1:
                    _write_file(work / f"dead0-{i}", str(rc))
                    others = [int(_wait_file(work / f"done{r}-{i}")) for r in range(1, world)]
                digest = tree_digest(out)
                if not (work / "states" / digest).exists():
                    shutil.copytree(out, work / "states" / digest, symlinks=True)
                results.append({"op": op, "action": action, "returncode": rc, "others": others, "digest": digest})
                shutil.rmtree(out)
                shutil.copytree(pristine, out, symlinks=True)
            else:
                rc, dead_since = None, None
                while rc is None:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                        break
                    if dead_since is None and (work / f"dead0-{i}").exists():
                        dead_since = time.time()
                    if dead_since is not None and time.time() - dead_since > 3:
                        os.kill(pid, signal.SIGKILL)  # what the launcher does to the rest of a failed launch
                    time.sleep(0.01)
                _write_file(work / f"done{rank}-{i}", str(rc))
        if rank == 0:
            _write_file(work / "results.json", json.dumps(results))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    checkpoints.AtomicCheckpointMixin._save_checkpoint = patched


def _install_signals(spec: dict) -> None:  # pragma: no cover (runs in a zygote child)
    """Make this run send itself ``spec["signal"]`` (``"SIGTERM"`` / ``"SIGINT"``) at the end of step (PPO: update)
    ``spec["step"]``, just before the stage's `StopOnSignal` looks; ``spec["again_after"]`` seconds later (if set) a
    second one, as a user who insists."""
    from rlhf_trl import checkpoints

    original = checkpoints.StopOnSignal.on_step_end
    signum = getattr(signal, spec["signal"])

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == spec["step"]:
            os.kill(os.getpid(), signum)
            if spec.get("again_after") is not None:
                time.sleep(spec["again_after"])
                os.kill(os.getpid(), signum)
        return original(self, args, state, control, **kwargs)

    checkpoints.StopOnSignal.on_step_end = on_step_end


def read_fault_log(path, save: int, rank: int = 0) -> list[tuple[int, str, str]]:
    """``(op, kind, path)`` of the file operations of checkpoint save ``save`` of process ``rank``, in order, from
    an ``RLHF_TRL_FAULT_LOG`` file."""
    ops = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        r, s, op, kind, where = line.split(" ", 4)
        if int(r) == rank and int(s) == save:
            ops.append((int(op), kind, where))
    assert [o for o, _, _ in ops] == list(range(1, len(ops) + 1)), f"{path}: save {save} ops out of order"
    return ops


# -- several processes without the launcher's start-up cost --------------------------------------------------------
def captured_launch_env(config: str, nproc: int, workdir) -> list[dict]:
    """The environment variables ``accelerate launch --config_file config --num_processes nproc`` gives each
    process (run once, with a script that writes its environment), minus torchelastic's agent variables: per rank,
    the variables that differ from this process's environment. `MASTER_PORT` is replaced per run by the caller."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    script = workdir / "dump_env.py"
    script.write_text("import json, os, sys\n"
                      "json.dump(dict(os.environ), open(os.path.join(sys.argv[1], os.environ['RANK'] + '.json'), 'w'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    launcher = os.path.join(os.path.dirname(sys.executable), "accelerate")
    subprocess.run([launcher, "launch", "--config_file", config, "--num_processes", str(nproc), "--main_process_port",
                    str(free_port()), str(script), str(workdir)], check=True, env=env, capture_output=True, timeout=300)
    ranks = []
    for r in range(nproc):
        seen = json.loads((workdir / f"{r}.json").read_text())
        ranks.append({k: v for k, v in seen.items() if env.get(k) != v and not k.startswith("TORCHELASTIC")})
    return ranks


class ZygoteGroup:
    """One `Zygote` per process of a launch: `run` starts a stage in each with that rank's launch environment
    (`captured_launch_env`, a fresh port) and returns the returncodes, rank 0 first. Like the launcher, when one
    process fails the others are killed after a grace of ``grace`` seconds."""

    def __init__(self, rank_envs: list[dict]):
        self.rank_envs = rank_envs
        self.zygotes = [Zygote() for _ in rank_envs]

    def run(self, stage: str, argv: list[str], log_prefix: str, env: dict | None = None, sweep: dict | None = None,
            timeout: float = 600, grace: float = 5) -> list[int]:
        port = str(free_port())
        pids = [z.start(stage, argv, f"{log_prefix}.rank{r}.log", {**renv, "MASTER_PORT": port, **(env or {})}, sweep)
                for r, (z, renv) in enumerate(zip(self.zygotes, self.rank_envs))]
        codes: list[int | None] = [None] * len(pids)
        deadline, failed_at = time.time() + timeout, None
        while any(c is None for c in codes):
            for r, z in enumerate(self.zygotes):
                if codes[r] is None:
                    answer = z.poll()
                    if answer is not None:
                        codes[r] = answer["returncode"]
                        if codes[r] != 0 and failed_at is None:
                            failed_at = time.time()
            time.sleep(0.02)
            late = (failed_at is not None and time.time() - failed_at > grace) or time.time() > deadline
            if late:
                for r, pid in enumerate(pids):
                    if codes[r] is None:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                failed_at = failed_at or time.time()
        return codes

    def close(self) -> None:
        for z in self.zygotes:
            z.close()
