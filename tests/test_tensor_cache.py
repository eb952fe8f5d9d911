"""`rlhf_trl.cpu.install_tensor_cache`: freed CPU tensor blocks are reused (same address, no fresh pages), a
larger kept block serves a request only when at most an eighth of it goes unused, a request no kept block fits is
made of the kept blocks' pages (no fresh page faults), the cache never raises the live footprint's peak by more than
its headroom, an update frees no kept block between its phases, training and a whole PPO run through it are bit for
bit the same, and without a C++ compiler the run goes on with a warning. Each check runs in a subprocess: the cache replaces the
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
d = block(2 * MB); assert d.data_ptr() != addr, "2 MB would leave a third of 3 MB unused (> 1/8): a new block"
s = cpu.tensor_cache_stats()
assert (s["hits"], s["misses"], s["kept_bytes"], s["live_bytes"]) == (2, 2, MB, 2 * MB), s
assert s["recycled_bytes"] == 2 * MB, "made of the kept 3 MB block's first 2 MB; its last 1 MB stays kept"
g = block(MB + 4096); grown = g.data_ptr(); del g
g = block(MB + 8192); assert g.data_ptr() == grown, "one size class (1 MB + 128 KB): a growing tensor reuses it"
del g
s = cpu.tensor_cache_stats(); assert s["hits"] == 3 and s["kept_bytes"] == MB + (128 << 10), s
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


RECYCLE = """
import resource, torch
from rlhf_trl import cpu
MB = 1 << 20
assert cpu.install_tensor_cache()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
held = [torch.full((MB // 4,), float(i)) for i in range(4)]  # 4 x 1 MB, every page touched
del held
before = faults()
x = torch.ones(3 * MB // 4)  # 3 MB: no kept block fits; made of the three oldest ones' pages
moved = faults() - before
s = cpu.tensor_cache_stats()
assert (s["recycled_bytes"], s["kept_bytes"], s["misses"]) == (3 * MB, MB, 5), s
assert s["mappings"] == 3 + 1, "x: three pieces; the kept 1 MB block: one"
assert x.sum().item() == 3 * MB // 4, "the new tensor holds what was written into it"
before = faults()
y = torch.ones(3 * MB // 4)  # nothing kept to cover it: 1 MB moved, 2 MB fresh pages
fresh = faults() - before
assert cpu.tensor_cache_stats()["mappings"] == 3 + 2, "y: the last kept block's pages and a fresh 2 MB"
del x, y
assert cpu.release_tensor_cache() == 6 * MB and cpu.tensor_cache_stats()["mappings"] == 0
print(moved, fresh)
"""


def test_a_request_no_kept_block_fits_is_made_of_their_pages(built):
    """3 MB from three kept 1 MB blocks: next to no page faults (the pages are in place), against one per fresh
    4 KB page for the next 3 MB, two thirds of which no kept block covers."""
    moved, fresh = map(int, run_script(RECYCLE).split())
    assert moved < 32 and fresh >= 2 * MB // 4096, (moved, fresh)


HEADROOM = """
import torch, sys
from rlhf_trl import cpu
MB = 1 << 20
assert cpu.install_tensor_cache(headroom_bytes=int(sys.argv[1]) * MB)
held = [torch.empty(MB // 8, dtype=torch.uint8) for _ in range(128)]  # peak: 16 MB live in 128 KB blocks
del held  # 16 MB kept
x = torch.empty(12 * MB, dtype=torch.uint8)  # the pages of 64 kept blocks (64 mappings at most): 8 MB, 4 MB fresh
s = cpu.tensor_cache_stats()
print(s["recycled_bytes"] // MB, s["kept_bytes"] // MB, s["live_bytes"] // MB)
"""


@pytest.mark.parametrize("headroom_mb, kept_mb", [(0, 4), (2, 6), (8, 8)])
def test_headroom_bounds_the_kept_blocks(built, headroom_mb, kept_mb):
    """live + kept <= peak (16 MB) + headroom: a 12 MB tensor made of 64 kept 128 KB blocks (a block is at most 64
    mappings) and 4 MB of fresh pages leaves 4 MB kept at 0 headroom, 6 at 2 MB, all 8 at 8 MB."""
    assert run_script(HEADROOM, str(headroom_mb)).split() == ["8", str(kept_mb), "12"]


TRAIN = """
import hashlib, sys, torch
from transformers import AutoModelForCausalLM
from rlhf_trl import cpu
if sys.argv[2] == "cache":
    assert cpu.install_tensor_cache(min_bytes=4096)  # the tiny model's tensors are small
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, model.config.vocab_size, (4, 48))
for _ in range(3):
    model(input_ids=ids, labels=ids).loss.backward()
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


PHASES = """
import json, resource, sys
from rlhf_trl import cpu, ppo, ppo_engine
seen = []
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
real_read = ppo_engine.OffloadedWeights.read

def read(self):
    before, start = cpu.tensor_cache_stats(), faults()
    real_read(self)
    after, end = cpu.tensor_cache_stats(), faults()
    big = sum(n for n in (p.numel() * p.element_size() for p in self.params.values()) if n >= 131072)
    seen.append({"faults": end - start, "big_pages": big // 4096, "taken": after["recycled_bytes"] -
                 before["recycled_bytes"] + after["hits"] - before["hits"]})

ppo_engine.OffloadedWeights.read = read
ppo.main(json.loads(sys.argv[1]))
print(json.dumps(seen))
"""


@pytest.mark.slow  # a PPO run of 2 updates in a subprocess (~20 s)
def test_an_update_makes_its_tensors_of_the_last_phases_pages(built, assets, sft_run, rm_run, tmp_path):
    """Nothing empties the cache between phases, and the offloaded reward model is read back into the allocator's
    tensors: in the second update its weights (those of >= 128 KB, the cache's) are kept blocks or made of their
    pages (the first update's freed blocks; moved, not zeroed again)."""
    import json

    argv = ppo_argv(assets, sft_run, rm_run, tmp_path, "--total_episodes", "16", "--save_strategy", "no",
                    "--tensor_cache", "true", "--offload_reward_model", "true")
    seen = json.loads(run_script(PHASES, json.dumps(argv)).splitlines()[-1])
    assert len(seen) == 3  # each update's scoring, then the end of training
    assert seen[1]["big_pages"] > 0 and seen[1]["taken"] > 0, seen
    assert seen[1]["faults"] < seen[1]["big_pages"] // 4, seen  # measured: 1 page fault for 459 pages of weights


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
    """`tensor_cache: true` end to end (installed before the models load; every phase's tensors from the kept
    blocks' pages): the same policy and value model, bit for bit, as the run without."""
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
