"""Reading at scale: normalise a generated N-row jsonl (default 1M rows) and report rows/s and peak RSS.

    python benchmarks/data_scale.py [--rows 1000000] [--shape implicit|messages|alpaca] [--workdir DIR] [--out FILE]

Writes a deterministic jsonl of ``--rows`` rows in ``--shape`` (implicit: Human/Assistant ``chosen`` / ``rejected``
transcripts of 1-3 turns, read as pairs; messages: ``messages: [{role, content}]`` with a system turn, read as SFT
records; alpaca: instruction / input / output, read as SFT records), then runs `rlhf_trl.data.read_records` on it in
a fresh child process with an empty `datasets` cache (so the JSON parse is counted, not a cache hit) and reports:

- ``rows_per_second``: rows / wall seconds of ``read_records`` (parse into Arrow + normalise into records), and
  ``rows_per_cpu_second``: rows / CPU seconds of the child in that call (Arrow's parser threads included; less
  sensitive to other jobs on a shared machine);
- ``peak_rss_bytes``: ``VmHWM`` of the child (its peak resident set over its whole life, imports included) and
  ``peak_rss_over_file``: that peak divided by the file size; ``import_rss_bytes``: the RSS after the imports
  (`datasets` is imported before the clock starts). The peak includes the pages of `datasets`' memory-mapped Arrow
  cache that the read touched (file-backed, reclaimable) besides the records themselves (``rss_after_bytes``);
- ``targets``: rows/s >= 50,000 and peak RSS <= 3x the file size, and whether each is met.

The JSON goes to stdout (and ``--out``). The generated file and the cache are deleted afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

from _measure import status_field  # noqa: E402  (benchmarks/ is on sys.path: scripts run from it)

TARGET_ROWS_PER_SECOND = 50_000
TARGET_RSS_OVER_FILE = 3.0

WORDS = ("the model answer question data reward policy value token prompt human assistant helpful honest safe "
         "please explain why how what when where could would should train learn read write small large fast slow "
         "good bad better worse first second third last example result").split()


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def make_row(rng: random.Random, shape: str, i: int) -> dict:
    """One generated row of ``shape`` (sizes like public preference / SFT data: ~0.5-1.5 kB per row)."""
    turns = rng.randint(1, 3)
    qs = [_sentence(rng, rng.randint(8, 30)) + f" #{i}" for _ in range(turns)]
    answers = [" ".join(_sentence(rng, rng.randint(6, 20)) for _ in range(rng.randint(1, 4))) for _ in range(turns)]
    if shape == "implicit":
        prompt = "".join(f"\n\nHuman: {q}\n\nAssistant: {a}" for q, a in zip(qs[:-1], answers[:-1]))
        prompt += f"\n\nHuman: {qs[-1]}\n\nAssistant:"
        return {"chosen": f"{prompt} {answers[-1]}", "rejected": f"{prompt} {_sentence(rng, rng.randint(6, 40))}"}
    if shape == "messages":
        messages = [{"role": "system", "content": "You are a helpful assistant."}]
        for q, a in zip(qs, answers):
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        return {"messages": messages}
    if shape == "alpaca":
        return {"instruction": qs[0], "input": qs[1] if turns > 1 else "", "output": answers[0]}
    raise ValueError(f"unknown shape {shape!r}")


KIND = {"implicit": "pairs", "messages": "sft", "alpaca": "sft"}


def generate(path: str, rows: int, shape: str, seed: int = 0) -> int:
    """Write ``rows`` rows of ``shape`` to ``path`` (jsonl); returns the file size in bytes."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        buf = []
        for i in range(rows):
            buf.append(json.dumps(make_row(rng, shape, i), ensure_ascii=False))
            if len(buf) == 10_000:
                f.write("\n".join(buf) + "\n")
                buf = []
        if buf:
            f.write("\n".join(buf) + "\n")
    return os.path.getsize(path)


def child(path: str, kind: str) -> dict:
    """Runs in the child process: read_records on ``path``; returns its figures."""
    import logging

    import datasets  # noqa: F401  (library imports are not per-row work: done before the clock starts)

    from rlhf_trl.data import DataArguments, read_records

    logging.basicConfig(level=logging.WARNING)
    import_rss = status_field("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    records = read_records(DataArguments(dataset_name=path, eval_split_size=0.0), kind)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"records": len(records), "seconds": seconds, "cpu_seconds": cpu, "peak_rss_bytes": status_field("VmHWM"),
            "import_rss_bytes": import_rss, "rss_after_bytes": status_field("VmRSS")}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--shape", choices=sorted(KIND), default="implicit")
    ap.add_argument("--workdir", default=None, help="where the jsonl and the datasets cache go (default: a temp dir)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the generated file and cache")
    ap.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        print(json.dumps(child(*args._child)))
        return {}

    work = args.workdir or tempfile.mkdtemp(prefix="data_scale_")
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, f"{args.shape}_{args.rows}.jsonl")
    t0 = time.perf_counter()
    file_bytes = generate(path, args.rows, args.shape)
    gen_seconds = time.perf_counter() - t0
    cache = os.path.join(work, "hf_datasets_cache")
    shutil.rmtree(cache, ignore_errors=True)
    env = dict(os.environ, HF_DATASETS_CACHE=cache, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                        "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--_child", path, KIND[args.shape]],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"data_scale: the child failed (exit {proc.returncode})")
    fig = json.loads(proc.stdout.strip().splitlines()[-1])
    rows_per_second = args.rows / fig["seconds"]
    ratio = fig["peak_rss_bytes"] / file_bytes
    result = {
        "rows": args.rows, "shape": args.shape, "kind": KIND[args.shape], "records": fig["records"],
        "file_bytes": file_bytes, "generate_seconds": round(gen_seconds, 1), "read_seconds": round(fig["seconds"], 2),
        "rows_per_second": round(rows_per_second), "cpu_seconds": round(fig["cpu_seconds"], 2),
        "rows_per_cpu_second": round(args.rows / fig["cpu_seconds"]), "peak_rss_bytes": fig["peak_rss_bytes"],
        "import_rss_bytes": fig["import_rss_bytes"], "rss_after_bytes": fig["rss_after_bytes"],
        "peak_rss_over_file": round(ratio, 2),
        "targets": {"rows_per_second": TARGET_ROWS_PER_SECOND, "peak_rss_over_file": TARGET_RSS_OVER_FILE},
        "targets_met": {"rows_per_second": rows_per_second >= TARGET_ROWS_PER_SECOND,
                        "peak_rss_over_file": ratio <= TARGET_RSS_OVER_FILE},
        "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
    }
    if not args.keep:
        shutil.rmtree(cache, ignore_errors=True)
        os.remove(path)
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
