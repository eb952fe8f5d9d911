"""`rlhf_trl.cpu.install_tensor_cache`: freed CPU tensor blocks are reused (same address, no fresh pages), the
cache never raises the live footprint's peak by more than its headroom, a larger kept block serves a request only
when at most an eighth of it goes unused, blocks set aside wait untouched and come back, PPO keeps training's blocks
through the rollout only as far as they fit under training's peak, training and a whole PPO run through it are bit
for bit the same, and without a C++ compiler the run goes on with a warning. Each check runs in a subprocess: the cache replaces the
process's CPU allocator."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import import_ppo
from safetensors.torch import load_file
from test_ppo import ppo_argv

from rlhf_trl import cpu
from rlhf_trl import ppo_engine

MB = 1 << 20


def run_script(script: str, *args: str, env: dict | None = None) -> str:
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def built():
    try:
        return cpu.build_tensor_cache()
    except RuntimeError as err:
        pytest.skip(f"the tensor cache cannot be built here: {err}")


REUSE = """
import torch
from rlhf_trl import cpu
MB = 1 << 20
assert cpu.install_tensor_cache(headroom_bytes=64 * MB)  # room enough: nothing is evicted here
def block(nbytes):
    return torch.empty(nbytes, dtype=torch.uint8)
a = block(3 * MB); addr = a.data_ptr(); del a
b = block(3 * MB); assert b.data_ptr() == addr, "same size: the kept block"
del b
c = block(3 * MB - (256 << 10)); assert c.data_ptr() == addr, "from the kept 3 MB block: 1/12 of it unused"
del c
d = block(2 * MB); assert d.data_ptr() != addr, "2 MB would leave a third of 3 MB unused (> 1/8): a fresh block"
s = cpu.tensor_cache_stats()
assert (s["hits"], s["misses"], s["kept_bytes"], s["live_bytes"]) == (2, 2, 3 * MB, 2 * MB), s
g = block(MB + 4096); grown = g.data_ptr(); del g
g = block(MB + 8192); assert g.data_ptr() == grown, "one size class (1 MB + 128 KB): a growing tensor reuses it"
del g
s = cpu.tensor_cache_stats(); assert s["hits"] == 3 and s["kept_bytes"] == 3 * MB + MB + (128 << 10), s
assert cpu.release_tensor_cache() == s["kept_bytes"]
small = block(64 << 10)
assert cpu.tensor_cache_stats()["misses"] == 3, "< 128 KB: not the cache's"
del d
assert cpu.uninstall_tensor_cache() == 2 * MB  # d's block was kept: the last one freed
e = block(3 * MB); del e  # PyTorch's own allocator again
assert cpu.tensor_cache_stats()["hits"] == 0
print("ok")
"""


def test_freed_blocks_are_reused(built):
    assert run_script(REUSE).split()[-1] == "ok"


HEADROOM = """
import torch, sys
from rlhf_trl import cpu
MB = 1 << 20
assert cpu.install_tensor_cache(headroom_bytes=int(sys.argv[1]) * MB)
held = [torch.empty(MB, dtype=torch.uint8) for _ in range(8)]  # peak: 8 MB live
del held  # 8 MB kept
x = torch.empty(3 * MB, dtype=torch.uint8)  # fits no kept block: a fresh one
s = cpu.tensor_cache_stats()
print(s["kept_bytes"] // MB, s["live_bytes"] // MB)
"""


@pytest.mark.parametrize("headroom_mb, kept_mb", [(0, 5), (2, 7), (8, 8)])
def test_headroom_bounds_the_kept_blocks(built, headroom_mb, kept_mb):
    """live + kept <= peak (8 MB) + headroom: with a 3 MB tensor live, 5 MB stay kept at 0 headroom, 7 at 2 MB, all
    8 at 8 MB."""
    assert run_script(HEADROOM, str(headroom_mb)).split() == [str(kept_mb), "3"]


RESET = """
import torch, sys
from rlhf_trl import cpu
MB = 1 << 20
assert cpu.install_tensor_cache()
held = [torch.empty(MB, dtype=torch.uint8) for _ in range(8)]  # peak: 8 MB live
del held
assert cpu.release_tensor_cache(reset_peak=sys.argv[1] == "reset") == 8 * MB
one = torch.empty(MB, dtype=torch.uint8); del one  # 1 MB kept
x = torch.empty(3 * MB, dtype=torch.uint8)  # a miss: within the old 8 MB peak, or a new 3 MB high after a reset
print(cpu.tensor_cache_stats()["kept_bytes"] // MB)
"""


@pytest.mark.parametrize("reset, kept_mb", [("keep", 1), ("reset", 0)])
def test_a_reset_peak_bounds_what_follows_by_its_own_peak(built, reset, kept_mb):
    assert run_script(RESET, reset).split() == [str(kept_mb)]


ASIDE = """
import torch
from rlhf_trl import cpu
MB = 1 << 20
assert cpu.install_tensor_cache(headroom_bytes=64 * MB)
def block(nbytes):
    return torch.empty(nbytes, dtype=torch.uint8)
a, b, c = block(2 * MB), block(3 * MB), block(4 * MB)
addr = {n: t.data_ptr() for n, t in (("a", a), ("b", b), ("c", c))}
del a, b, c  # freed in this order: c is the most recently freed
assert cpu.set_aside_tensor_cache(5 * MB) == 4 * MB, "c (4 MB) first; b (3 MB) would pass 5 MB; a (2 MB) neither"
s = cpu.tensor_cache_stats()
assert (s["kept_bytes"], s["aside_bytes"], s["peak_live_bytes"]) == (0, 4 * MB, 0), s
x = block(4 * MB); assert x.data_ptr() != addr["c"], "a block set aside is handed out to nobody"
del x
assert cpu.release_tensor_cache() == 4 * MB and cpu.tensor_cache_stats()["aside_bytes"] == 4 * MB, "x's, not c's"
assert cpu.restore_tensor_cache() == 4 * MB
s = cpu.tensor_cache_stats()
assert (s["kept_bytes"], s["aside_bytes"], s["peak_live_bytes"]) == (4 * MB, 0, 4 * MB), s
y = block(4 * MB); assert y.data_ptr() == addr["c"], "restored: kept again"
del y
assert cpu.set_aside_tensor_cache(MB, reset_peak=False) == 0 and cpu.tensor_cache_stats()["peak_live_bytes"] == 4 * MB
z = block(4 * MB); del z
assert cpu.set_aside_tensor_cache(8 * MB) == 4 * MB
assert cpu.uninstall_tensor_cache() == 4 * MB, "blocks set aside go with the cache"
print("ok")
"""


def test_blocks_set_aside_wait_untouched_and_come_back(built):
    assert run_script(ASIDE).split()[-1] == "ok"


TRAIN = """
import hashlib, sys, torch
from transformers import AutoModelForCausalLM
from rlhf_trl import cpu
from rlhf_trl.ppo_engine import state_gets_own_blocks
if sys.argv[2] == "cache":
    assert cpu.install_tensor_cache(min_bytes=4096)  # the tiny model's tensors are small
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, model.config.vocab_size, (4, 48))
for _ in range(3):
    model(input_ids=ids, labels=ids).loss.backward()
    with state_gets_own_blocks(opt):
        opt.step()
    opt.zero_grad(set_to_none=True)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
print(digest, cpu.tensor_cache_stats()["hits"])
"""


def test_training_through_the_cache_is_bit_for_bit_the_same(built, assets):
    plain_digest, plain_hits = run_script(TRAIN, assets["base_model"], "plain").split()
    cached_digest, cached_hits = run_script(TRAIN, assets["base_model"], "cache").split()
    assert cached_digest == plain_digest
    assert plain_hits == "0" and int(cached_hits) > 100  # the steps after the first reuse their blocks


def test_new_optimizer_state_gets_blocks_of_its_own(monkeypatch):
    """Only a step that makes state sets the kept blocks aside, as many as fit beside the state (2 x 12 bytes here)
    under the peak so far, and restores them after the step."""
    calls = []
    monkeypatch.setattr(ppo_engine, "tensor_cache_installed", lambda: True)
    monkeypatch.setattr(ppo_engine, "tensor_cache_stats", lambda: {"peak_live_bytes": 1000, "live_bytes": 600})
    monkeypatch.setattr(ppo_engine, "set_aside_tensor_cache",
                        lambda n, reset_peak=True: calls.append(("set_aside", n, reset_peak)))
    monkeypatch.setattr(ppo_engine, "restore_tensor_cache", lambda: calls.append("restore"))
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w])
    with ppo_engine.state_gets_own_blocks(opt):
        pass
    assert calls == []  # no gradient: no state to make
    w.grad = torch.ones(3)
    with ppo_engine.state_gets_own_blocks(opt):
        assert calls == [("set_aside", 1000 - 600 - 2 * 3 * 4, False)]
        opt.step()  # AdamW's moments now exist
    assert calls[-1] == "restore"
    with ppo_engine.state_gets_own_blocks(opt):
        opt.step()
    assert len(calls) == 2


def test_training_blocks_wait_through_the_rollout_as_far_as_they_fit(monkeypatch):
    """Set aside: training's peak - the live bytes now - the most generate or scoring rose above its start (the
    offloaded reward model's weights counted) - the headroom; nothing before an update has trained."""
    stats = {"peak_live_bytes": 0, "live_bytes": 0}
    monkeypatch.setattr(ppo_engine, "tensor_cache_installed", lambda: True)
    monkeypatch.setattr(ppo_engine, "tensor_cache_stats", lambda: dict(stats))
    engine = ppo_engine.PPOEngine.__new__(ppo_engine.PPOEngine)  # the bookkeeping alone, no models
    engine.args = ppo_engine.PPOConfig(output_dir="unused", bf16=False, use_cpu=True, tensor_cache_headroom_mb=1)
    engine.phase_peaks, engine.phase_start_live = {}, 0
    engine.reward_offload = type("Offloaded", (), {"nbytes": 300 * MB})()

    def phase(name, live_at_end, peak):
        stats.update(live_bytes=live_at_end * MB, peak_live_bytes=peak * MB)
        engine.end_phase(name)

    phase("training", 4000, 4000)  # model loading: no update has trained yet
    assert "training" not in engine.phase_peaks and engine.set_aside_budget() == 0
    phase("generate", 4000, 5500)  # rose 1500 MB above its start
    phase("scoring", 4000, 5000)  # 1000 MB + 300 MB of offloaded weights
    assert engine.phase_peaks == {"generate": 1500 * MB, "scoring": 1300 * MB}
    assert engine.set_aside_budget() == 0  # nothing has trained yet
    phase("training", 6000, 9000)  # AdamW's state came: 6000 MB live after training
    assert engine.set_aside_budget() == (9000 - 6000 - 1500 - 1) * MB
    stats.update(live_bytes=8000 * MB)
    assert engine.set_aside_budget() == 0  # no room under training's peak


def test_each_phase_of_an_update_starts_from_an_empty_cache(assets, sft_run, rm_run, tmp_path, monkeypatch):
    """The loop empties the cache and restarts its peak before generate (training's blocks set aside, as far as
    they fit: none without the cache), between generate and scoring, and between scoring and training (the blocks
    set aside come back): no phase's footprint is raised by the blocks the phase before it left (training's
    activations, generate's merged copies and KV cache)."""
    ppo, events = import_ppo(), []

    def mark(name, real):
        def wrapper(*args, **kwargs):
            if not events or events[-1] != name:  # scoring runs once per rollout chunk
                events.append(name)
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(ppo_engine, "release_tensor_cache",
                        lambda reset_peak=False: events.append(("release", reset_peak)) or 0)
    monkeypatch.setattr(ppo_engine, "set_aside_tensor_cache",
                        lambda n, reset_peak=True: events.append(("set_aside", n, reset_peak)) or 0)
    monkeypatch.setattr(ppo_engine, "restore_tensor_cache", lambda: events.append("restore") or 0)
    monkeypatch.setattr(ppo_engine, "generate_rollouts", mark("generate", ppo_engine.generate_rollouts))
    for name in ("score_rollouts", "optimise"):
        monkeypatch.setattr(ppo_engine.PPOEngine, name, mark(name, getattr(ppo_engine.PPOEngine, name)))
    ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path, "--total_episodes", "16", "--save_strategy", "no"))
    update = [("set_aside", 0, True), "generate", ("release", True), "score_rollouts", ("release", True), "restore",
              "optimise"]
    assert events == update * 2


@pytest.mark.slow  # two PPO runs of 3 updates (~25 s)
def test_the_value_models_gradients_are_kept_between_updates(assets, sft_run, rm_run, tmp_path, monkeypatch):
    """With the tensor cache, `value_step` adds each update's gradients into the last update's tensors, zeroed,
    instead of fresh ones: the same tensors every update, and the same weights, bit for bit, as without."""
    ppo, pointers = import_ppo(), []
    real_value_step = ppo_engine.PPOEngine.value_step

    def value_step(self, *args):
        out = real_value_step(self, *args)
        pointers.append([g.data_ptr() for g in self.value_grads or [] if g is not None])
        return out

    weights = {}
    for mode in ("plain", "kept"):
        if mode == "kept":
            monkeypatch.setattr(ppo_engine, "tensor_cache_installed", lambda: True)
            monkeypatch.setattr(ppo_engine.PPOEngine, "value_step", value_step)
        out = tmp_path / mode
        ppo.main(ppo_argv(assets, sft_run, rm_run, out, "--total_episodes", "24", "--save_strategy", "no",
                          "--num_ppo_epochs", "1", "--num_mini_batches", "1"))
        weights[mode] = load_file(str(out / "value_model" / "model.safetensors"))
    assert len(pointers) == 3 and pointers[0] and pointers[0] == pointers[1] == pointers[2]
    assert weights["plain"].keys() == weights["kept"].keys()
    assert all(torch.equal(weights["plain"][k], weights["kept"][k]) for k in weights["plain"])


def test_without_a_compiler_the_run_goes_on_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RLHF_TRL_CACHE", str(tmp_path))  # no earlier build to reuse
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(RuntimeError, match=r"^tensor_cache: building tensor_cache.cpp with .*no-such-c\+\+ failed"):
        cpu.build_tensor_cache()
    assert cpu.install_tensor_cache() is False
    assert "PyTorch's own CPU allocator stays" in caplog.text
    assert cpu.tensor_cache_stats()["hits"] == 0 and cpu.release_tensor_cache() == 0
    assert list(tmp_path.glob("ext/*")) == []  # no half-written library left behind


def test_a_negative_headroom_stops_the_run_before_anything_is_read(assets, sft_run, rm_run, tmp_path):
    ppo = import_ppo()
    with pytest.raises(ValueError, match=r"^tensor_cache_headroom_mb must be >= 0 MB, got -1$"):
        ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path / "out", "--tensor_cache", "true",
                          "--tensor_cache_headroom_mb", "-1"))
    assert not cpu.tensor_cache_installed()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match=r"^tensor_cache: headroom \(-1\) and min_bytes \(0\) must be >= 0 bytes$"):
        cpu.install_tensor_cache(-1, 0)
    with pytest.raises(ValueError, match=r"^tensor_cache: max_unused must be in \[0, 1\), got 1.0$"):
        cpu.install_tensor_cache(max_unused=1.0)


@pytest.mark.slow  # two PPO runs of 2 updates in subprocesses (~40 s)
def test_a_ppo_run_through_the_cache_is_bit_for_bit_the_same(built, assets, sft_run, rm_run, tmp_path):
    """`tensor_cache: true` end to end (install before the models load, the release before the optimisation phase
    and before AdamW makes its state): the same policy and value model, bit for bit, as the run without."""
    weights = {}
    for mode in ("plain", "cache"):
        out = tmp_path / mode
        argv = ppo_argv(assets, sft_run, rm_run, out, "--total_episodes", "16", "--save_strategy", "no",
                        "--tensor_cache", str(mode == "cache").lower())
        done = subprocess.run([sys.executable, "-m", "rlhf_trl", "ppo", *argv], capture_output=True, text=True,
                              timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        assert ("tensor_cache: CPU tensors >= 131072 bytes reuse freed blocks" in done.stderr) == (mode == "cache")
        weights[mode] = {name: load_file(str(out / name / "model.safetensors")) for name in ("merged", "value_model")}
    for name, plain in weights["plain"].items():
        cached = weights["cache"][name]
        assert plain.keys() == cached.keys()
        assert all(torch.equal(plain[k], cached[k]) for k in plain), name
