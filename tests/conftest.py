import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED = (REPO / ".." / "shared").resolve()


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """The demo assets (data files, tokenizer, random-init tiny Qwen2), built once per test session."""
    from rlhf_trl.demo import build_assets

    return build_assets(str(tmp_path_factory.mktemp("demo_assets")))


@pytest.fixture(scope="session")
def tokenizer(assets):
    from rlhf_trl.models import load_tokenizer

    return load_tokenizer(assets["tokenizer"])


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return str(path)
