"""Stages run in fresh processes for the exactness tests (test_exact_resume.py, test_fault_injection.py), without
paying the import time for each run.

`Zygote`: a process that imports torch, transformers, TRL and the stages once, then forks a child per request to
run a stage (``rlhf-trl <stage> ARGS``) with extra environment variables, and reports how the child ended
(``returncode``: exit status, or minus the signal that killed it, as `subprocess` does). Each child is a fresh
process as far as the run is concerned (nothing ran in the zygote but imports); it saves the seconds of importing.
A request can also make its child sweep every file operation of one checkpoint save with a kill (`_install_sweep`)
or signal itself at a given step (`_install_signals`).

Several processes: `ZygoteGroup` runs one zygote per rank with the environment ``accelerate launch`` gives each
(`captured_launch_env`); `accelerate_launch` runs the real launcher. `small_models` trains the SFT and reward models
the configurations of exactness.py start from. Comparing the runs is exactness.py's job.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from exactness import RECIPES, tree_digest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
MULTI_CPU = REPO / "recipes" / "accelerate_configs" / "multi_cpu.yaml"


# -- the fork server -----------------------------------------------------------------------------------------------
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
            _run_child(_serve, req, cli)
        answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        answer({"returncode": _returncode(status)})


def _serve(req: dict, cli) -> int:
    """A forked child's run of request ``req``: its log file as stdout / stderr, its environment, fault sweep and
    signal hooks, then the stage; returns the exit status."""
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
    return cli.main([req["stage"], *req["argv"]]) or 0


def _run_child(body, *args) -> None:
    """The whole life of a forked child: ``body(*args)`` gives the exit status (`SystemExit`: its code; another
    exception: its traceback, status 1), then flush and ``os._exit``: never back into the parent's code."""
    code = 1
    try:
        code = body(*args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _returncode(status: int) -> int:
    """`os.waitpid`'s status as subprocess reports it: the exit status, or minus the signal that killed it."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


class Zygote:
    """Client of `_zygote_main` (see the module docstring). ``env`` is the zygote's environment (the children get
    it plus each request's ``env``)."""

    def __init__(self, env: dict | None = None):
        base = {k: v for k, v in os.environ.items() if not k.startswith("RLHF_TRL_FAULT")}
        base.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                    PYTHONUNBUFFERED="1", RLHF_TRL_DEBUG="1")
        base["PYTHONPATH"] = os.pathsep.join(p for p in (source_dir(), str(TESTS), base.get("PYTHONPATH")) if p)
        base.update(env or {})
        self.proc = subprocess.Popen([sys.executable, "-c", "import zygote; zygote._zygote_main()"],
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



# -- the inputs of the configurations ------------------------------------------------------------------------------
def small_models(zygote: Zygote, assets: dict, workdir) -> tuple[str, str]:
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
                def faulty_save(op: str, action: str, port: int, python_rng) -> int:
                    random.setstate(python_rng)  # `random` reseeds itself in a forked child; the save records it
                    os.environ["RLHF_TRL_FAULT"] = f"{spec['save']}:{op}:{action}"
                    os.environ.pop("RLHF_TRL_FAULT_LOG", None)
                    if world > 1:
                        _rejoin_process_group(port, rank, world)
                    original(self, model, trial)
                    return SURVIVED

                _run_child(faulty_save, op, action, port, python_rng)
            if rank == 0:
                _, status = os.waitpid(pid, 0)
                rc = _returncode(status)
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
                        rc = _returncode(status)
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


# -- the real launcher -------------------------------------------------------------------------------------------
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
