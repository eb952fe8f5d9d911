"""Run one stage in this process and record its timing and memory as JSON (a helper of benchmarks/bench.py).

    python benchmarks/_measure.py --out run.json [--preimport mod1,mod2] [--sample] [--count_weights] -m rlhf_trl.cli ...
    python benchmarks/_measure.py --out run.json [--preimport mod1,mod2] [--sample] benchmarks/plain_trl.py sft ...

The target (a module with ``-m``, or a script path) runs as ``__main__`` with the remaining arguments, exactly as
``python -m MODULE ARGS`` / ``python SCRIPT ARGS`` would run it. Before that this helper

  - imports the ``--preimport`` modules and records the resident set size (RSS) right after them, before any model is
    loaded (``baseline_rss_bytes``: the import baseline of ``ppo_model_copies``);
  - hooks `transformers.trainer_callback.CallbackHandler` (every Trainer, and TRL's PPOTrainer, calls it) to record
    the times of ``on_train_begin``, each ``on_step_end`` and ``on_train_end``: ``train_seconds`` is the time from
    train begin to train end, ``step_seconds`` the time between consecutive step ends (the first counted from train
    begin). The hook costs the same on both sides of an overhead comparison.

Written to ``--out``: ``exit_code``, ``seconds`` (from this helper's start to the target's end, imports included),
``train_seconds``, ``step_seconds``, ``peak_rss_bytes`` (``VmHWM`` of this process: the peak over its whole
life), ``baseline_rss_bytes`` (or null without ``--preimport``), ``rss_after_import_bytes`` (RSS once
transformers' trainer callbacks are imported), ``train_begin_seconds``. With ``--sample`` a thread also reads
/proc/self/status every 10 ms: ``peak_rss_anon_bytes`` (anonymous memory: tensors, optimizer state),
``peak_rss_file_bytes`` (file pages mapped in, e.g. safetensors files while a model loads), ``peak_vmrss_sampled_bytes``
and ``peak_time_seconds`` (when the sampled RSS peaked), ``phase_peak_bytes`` (the sampled peaks of each phase: ``load``
before training, ``train``, ``save`` after it); ``baseline_rss_anon_bytes`` and ``baseline_rss_file_bytes`` go with ``--preimport``. With ``--count_weights``,
``weight_bytes_held``: at train begin, the bytes of the distinct parameter storages of all models alive (shared or
tied weights once; optimizer state and activations not included).
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import runpy  # noqa: E402
import sys  # noqa: E402


def rss_bytes() -> int:
    """Current resident set size of this process (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far: ``VmHWM`` of /proc/self/status (Linux).

    Not ``ru_maxrss``: Linux copies that figure from the parent at fork and keeps it across exec, so a child
    started by a large parent (bench.py holds models) would report the parent's peak.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def status_field(key: str) -> int:
    """One byte-valued field of /proc/self/status (``VmRSS``, ``VmHWM``, ...), 0 where it is missing."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def status_bytes() -> dict:
    """VmRSS, RssAnon (heap: tensors) and RssFile (mapped files, e.g. safetensors being loaded) in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) * 1024
    return out


PHASE = ["load"]  # "load" until train begins, "train" until it ends, then "save"


class Sampler:
    """Samples /proc/self/status every ``interval`` seconds in a daemon thread; keeps the peak of each field and the
    time (seconds since this helper started) of the VmRSS peak."""

    def __init__(self, interval: float = 0.01):
        import threading

        self.peak: dict = {}
        self.phase_peak: dict = {}
        self.peak_time = None
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.interval)

    def sample(self):
        now = status_bytes()
        for key, value in now.items():
            if value > self.peak.get(key, -1):
                self.peak[key] = value
                if key == "VmRSS":
                    self.peak_time = time.perf_counter() - T0
        phase = self.phase_peak.setdefault(PHASE[0], {})
        for key, value in now.items():
            phase[key] = max(phase.get(key, 0), value)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self.sample()
        return {"peak_vmrss_sampled_bytes": self.peak.get("VmRSS"), "peak_rss_anon_bytes": self.peak.get("RssAnon"),
                "peak_rss_file_bytes": self.peak.get("RssFile"), "peak_time_seconds": self.peak_time,
                "phase_peak_bytes": {name: {"rss": v.get("VmRSS"), "anon": v.get("RssAnon"), "file": v.get("RssFile")}
                                     for name, v in self.phase_peak.items()}}


def weight_bytes_held() -> dict:
    """Bytes of the distinct parameter storages of every `transformers.PreTrainedModel` alive in this process.

    Models wrapped by peft or TRL are found through their inner PreTrainedModel; tied or shared weights (a reward
    model reused as the value model's base, a reference that is the policy with its adapter disabled) count once.
    Returns ``{"all": bytes, "base": bytes}``: ``base`` leaves out LoRA adapters (``lora_*``) and the trainable
    copies of heads peft keeps next to the originals (``modules_to_save``): the copies of base weights.
    """
    import gc

    from transformers import PreTrainedModel

    storages, base = {}, {}
    for obj in gc.get_objects():
        if isinstance(obj, PreTrainedModel):
            for name, p in obj.named_parameters():
                storage = p.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
                if "lora_" not in name and "modules_to_save" not in name:
                    base[storage.data_ptr()] = storage.nbytes()
    return {"all": sum(storages.values()), "base": sum(base.values())}


def main() -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--preimport", default="", help="comma-separated modules imported before the baseline RSS")
    p.add_argument("--sample", action="store_true", help="sample RssAnon / RssFile every 10 ms")
    p.add_argument("--count_weights", action="store_true", help="count distinct weight bytes at train begin")
    p.add_argument("-m", dest="module", help="run this module as __main__ (else the first target argument is a script)")
    p.add_argument("target", nargs=argparse.REMAINDER, help="script and its arguments, or the module's arguments")
    args = p.parse_args()
    if not args.module and not args.target:
        p.error("give -m MODULE or a script")
    out, sample, count_weights = args.out, args.sample, args.count_weights
    preimport = [m for m in args.preimport.split(",") if m]
    argv = ["-m", args.module, *args.target] if args.module else list(args.target)

    import importlib

    baseline = baseline_status = None
    if preimport:
        for name in preimport:
            importlib.import_module(name)
        baseline = rss_bytes()
        baseline_status = status_bytes()
    sampler = Sampler() if sample else None

    from transformers.trainer_callback import CallbackHandler

    rss_after_import = rss_bytes()
    marks: dict = {"train_begin": None, "train_end": None, "step_ends": []}

    def hook(name, record):
        original = getattr(CallbackHandler, name)

        def wrapped(self, *args, **kwargs):
            record(time.perf_counter())
            return original(self, *args, **kwargs)

        setattr(CallbackHandler, name, wrapped)

    def mark(name, phase):
        def record(t):
            marks[name] = t
            PHASE[0] = phase
            if count_weights and name == "train_begin":
                held = weight_bytes_held()
                marks["weight_bytes_held"], marks["base_weight_bytes_held"] = held["all"], held["base"]
        return record

    hook("on_train_begin", mark("train_begin", "train"))
    hook("on_step_end", marks["step_ends"].append)
    hook("on_train_end", mark("train_end", "save"))

    if argv[0] == "-m":
        target, rest, run = argv[1], argv[2:], lambda: runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        target, rest = argv[0], argv[1:]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        run = lambda: runpy.run_path(target, run_name="__main__")  # noqa: E731
    sys.argv = [target, *rest]
    code = 0
    try:
        run()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    end = time.perf_counter()
    sampled = sampler.stop() if sampler is not None else {}

    begin, steps = marks["train_begin"], marks["step_ends"]
    step_seconds = [b - a for a, b in zip([begin, *steps[:-1]], steps)] if begin is not None else []
    result = {
        "exit_code": code,
        "seconds": end - T0,
        "train_seconds": (marks["train_end"] - begin) if begin is not None and marks["train_end"] else None,
        "step_seconds": step_seconds,
        "peak_rss_bytes": peak_rss_bytes(),
        "baseline_rss_bytes": baseline,
        "rss_after_import_bytes": rss_after_import,
        "baseline_rss_anon_bytes": (baseline_status or {}).get("RssAnon"),
        "baseline_rss_file_bytes": (baseline_status or {}).get("RssFile"),
        "preimport": preimport,
        "train_begin_seconds": (begin - T0) if begin is not None else None,
        "weight_bytes_held": marks.get("weight_bytes_held"),
        "base_weight_bytes_held": marks.get("base_weight_bytes_held"),
        **sampled,
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    return code


if __name__ == "__main__":
    sys.exit(main())
