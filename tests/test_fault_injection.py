"""SIGKILL at every file operation of a checkpoint save, then resume from what is on disk: the resumed run ends
bit-exact with the uninterrupted one.

For each configuration of `exactness.stage_configs` (SFT, RM, PPO, PPO with a LoRA value model, with
``share_reward_value_base``, with ``reward_baseline: auto``, and PPO under 2 processes):

1. the uninterrupted run, with ``RLHF_TRL_FAULT_LOG``: the file operations of its 2nd checkpoint save (process 0:
   every write, fsync, rename, remove, rotation; `faults`, tests/fault_hooks) are the kill points, K of them;
2. for every k in 1..K the save dies with ``RLHF_TRL_FAULT="2:k"`` (asserted: SIGKILL, returncode -9; under 2
   processes process 0 is SIGKILLed and the launch fails: the other process is killed as the launcher kills it),
   plus ``torn`` writes (written, cut to half, SIGKILL) at the save's first, middle and last write; ``2:K+1`` must
   not fire;
3. no half-written checkpoint is visible: every ``checkpoint-N`` left on disk holds, file for file, what the
   uninterrupted run's ``checkpoint-N`` holds (`exactness.assert_trees_equal`);
4. the run resumes (``resume_from_checkpoint=true``, a fresh process) from what is on disk, removing the killed
   save's ``.tmp-checkpoint-N`` staging directory (asserted: the kills left one, the resumed runs hold none), and ends
   with the uninterrupted run's weights, optimizer, scheduler, RNG and data state, KL coefficient and log history
   (`exactness.assert_runs_equal`).

To keep the file within its time budget (<= 12 min on 2 cores) two things are shared:

- **one resume per distinct on-disk state**: a resume sees only the files outside ``.tmp-*`` staging directories
  (it removes those before anything else), so kill points that left the same tree (`exactness.tree_digest`: every
  file outside staging, path and bytes) resume identically; each distinct tree is resumed once and its result
  stands for every kill point that left it (every k is still killed and asserted);
- **one run up to the 2nd save**: the stage runs once, in a fresh process, up to its 2nd checkpoint save; there it
  forks one child per kill point, which does the save with ``RLHF_TRL_FAULT="2:k"`` and dies (`zygote`'s sweep);
  after each child the output directory is recorded and put back as it was before the save. The children start
  from the very state a fresh run has at that save (the run is deterministic); to hold the sweep to that, one fresh
  run per configuration is killed with ``RLHF_TRL_FAULT="2:k"`` from the start (k: right after the rename that
  publishes the checkpoint) and must leave the same tree as the sweep's child for that k. Under 2 processes each
  process forks its child and the children form a new gloo group; the processes are started from a fork server
  with the environment ``accelerate launch`` gives them (`zygote.captured_launch_env`), to save the launcher's
  start-up per run.

Kill points of one save (K: process 0's 2nd checkpoint save) and distinct on-disk states after its K kills and 3
torn writes (trees outside staging), measured (`pytest -s` prints them):

| configuration | K | writes / fsyncs / rename, remove, rotate | distinct states |
|---|---|---|---|
| sft | 29 | 12 / 14 / 1, 1, 1 | 2: kill 1-26 and torn (newest checkpoint-3); kill 27-29 (checkpoint-6 published) |
| rm | 29 | 12 / 14 / 1, 1, 1 | 2: kill 1-26 and torn; kill 27-29 |
| ppo | 47 | 19 / 25 / 1, 1, 1 | 2: kill 1-44 and torn (newest checkpoint-1); kill 45-47 (checkpoint-2 published) |
| ppo_value_lora | 49 | 20 / 26 / 1, 1, 1 | 2: kill 1-46 and torn; kill 47-49 |
| ppo_shared_base | 49 | 20 / 26 / 1, 1, 1 | 2: kill 1-46 and torn; kill 47-49 |
| ppo_baseline_auto | 47 | 19 / 25 / 1, 1, 1 | 2: kill 1-44 and torn; kill 45-47 |
| ppo_2proc | 49 | 19 / 27 / 1, 1, 1 | 2: kill 1-46 and torn; kill 47-49 |

(The last write before the rename is the checkpoint's ``manifest.json``.)

Every kill before the rename that publishes the checkpoint leaves the same tree outside staging (the save writes
only under ``.tmp-checkpoint-N``), every later one the same tree with the new checkpoint. Measured: the whole file
in 5 min 6 s on 2 cores (ppo_2proc 83 s, the other PPO configurations 36-38 s each, SFT and RM 18-20 s each,
building the assets and the small models 22 s); 7 min 38 s while other jobs shared the cores.
"""

import json
import os
import shutil

import pytest
from exactness import assert_runs_equal, assert_trees_equal, checkpoints
from zygote import MULTI_CPU, SURVIVED, ZygoteGroup, captured_launch_env, read_fault_log, tail

pytestmark = pytest.mark.slow

NAMES = ["sft", "rm", "ppo", "ppo_value_lora", "ppo_shared_base", "ppo_baseline_auto", "ppo_2proc"]
SAVE = 2  # the checkpoint save whose every file operation is a kill point


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    g = ZygoteGroup(captured_launch_env(str(MULTI_CPU), 2, tmp_path_factory.mktemp("launch_env")))
    yield g
    g.close()


def runner(cfg, request):
    """``run(argv, log, env, sweep) -> returncodes`` (process 0 first) for the configuration's process count."""
    if cfg.nproc == 1:
        z = request.getfixturevalue("zygote")
        return lambda argv, log, env=None, sweep=None: [z.run(cfg.stage, argv, log, env, sweep)]
    g = request.getfixturevalue("group")
    return lambda argv, log, env=None, sweep=None: g.run(cfg.stage, argv, log, env, sweep)


def assert_no_half_written_checkpoint(tree, reference) -> None:
    """Every ``checkpoint-N`` in ``tree`` holds what the uninterrupted run's ``checkpoint-N`` holds."""
    for step in checkpoints(tree):
        assert step in checkpoints(reference), f"{tree}: checkpoint-{step} the uninterrupted run never wrote"
        assert_trees_equal(tree, reference, f"checkpoint-{step}")


@pytest.mark.parametrize("name", NAMES)
def test_kill_at_every_file_operation_then_resume_exactly(name, configs, request, tmp_path):
    cfg = configs[name]
    run = runner(cfg, request)
    ok = [0] * cfg.nproc
    log = str(tmp_path / "log")

    # 1. the uninterrupted run and the kill points of its 2nd save
    reference, oplog = tmp_path / "reference", tmp_path / "ops.log"
    assert run([*cfg.argv, "--output_dir", str(reference)], log, {"RLHF_TRL_FAULT_LOG": str(oplog)}) == ok, tail(log)
    assert checkpoints(reference) == cfg.checkpoints
    ops = read_fault_log(oplog, SAVE)
    kinds = [kind for _, kind, _ in ops]
    k_count = len(ops)
    writes = [op for op, kind, _ in ops if kind == "write"]
    assert k_count and writes and "rename" in kinds and "fsync" in kinds
    torn = sorted({writes[0], writes[len(writes) // 2], writes[-1]})
    points = [[k, "kill"] for k in range(1, k_count + 1)] + [[k, "torn"] for k in torn] + [[k_count + 1, "kill"]]

    # 2. the sweep: every kill point of the 2nd save
    work = tmp_path / "sweep"
    work.mkdir()
    out = work / "out"
    sweep = {"save": SAVE, "points": points, "workdir": str(work)}
    assert run([*cfg.argv, "--output_dir", str(out)], log, {"RLHF_TRL_FAULT_LOG": str(work / "ops.log")},
               sweep) == ok, tail(log)
    results = json.loads((work / "results.json").read_text())
    assert [[r["op"], r["action"]] for r in results] == points
    for r in results[:-1]:
        assert r["returncode"] == -9, (r, tail(log))  # SIGKILL
        assert all(code != 0 for code in r["others"]), r  # under 2 processes: the launch failed
    assert results[-1]["returncode"] == SURVIVED, "a fault after the save's last file operation fired"
    states: dict[str, list] = {}
    for r in results[:-1]:
        states.setdefault(r["digest"], []).append(f"{r['op']}:{r['action']}")

    # the sweep's children are fresh runs killed at k: one fresh run, killed right after the publishing rename
    publish = max(op for op, kind, _ in ops if kind == "rename") + 1
    fresh = tmp_path / "fresh"
    codes = run([*cfg.argv, "--output_dir", str(fresh)], log, {"RLHF_TRL_FAULT": f"{SAVE}:{publish}"})
    assert codes[0] == -9, tail(log)
    assert_trees_equal(fresh, work / "states" / next(r["digest"] for r in results if r["op"] == publish))

    # 3. + 4. each distinct tree: no half-written checkpoint; resume from it (which removes the killed save's staging
    # directory); bit-exact with the uninterrupted run
    staged = []
    for i, (digest, where) in enumerate(states.items()):
        tree = work / "states" / digest
        assert_no_half_written_checkpoint(tree, reference)
        staged += [name for name in os.listdir(tree) if name.startswith(".tmp-")]
        resumed = tmp_path / f"resumed-{i}"
        shutil.copytree(tree, resumed, symlinks=True)
        assert run([*cfg.argv, "--output_dir", str(resumed), "--resume_from_checkpoint", "true"], log) == ok, \
            (where, tail(log))
        assert not [name for name in os.listdir(resumed) if name.startswith(".tmp-")], where
        assert_runs_equal(reference, resumed)
    # the kills before the save removes its staging directory left it, and the resumes above removed it
    assert staged and set(staged) == {f".tmp-checkpoint-{cfg.checkpoints[SAVE - 1]}"}, staged
    counts = ", ".join(f"{kind} {kinds.count(kind)}" for kind in sorted(set(kinds)))
    print(f"\n{name}: K={k_count} kill points ({counts}); {len(states)} distinct on-disk states: "
          + "; ".join(_spans(w) for w in states.values()))


def _spans(points: list[str]) -> str:
    """``["1:kill", "2:kill", "3:kill", "6:torn"]`` -> ``"kill 1-3, torn 6"``."""
    out = []
    for action in ("kill", "torn"):
        ops = sorted(int(p.split(":")[0]) for p in points if p.endswith(":" + action))
        runs: list[list[int]] = []
        for op in ops:
            if runs and op == runs[-1][1] + 1:
                runs[-1][1] = op
            else:
                runs.append([op, op])
        if runs:
            out.append(f"{action} " + ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs))
    return " + ".join(out)
