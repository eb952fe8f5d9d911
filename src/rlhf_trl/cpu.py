"""PPO's CPU measures, all opt-in recipe keys: `onednn_decoding` (faster token-by-token generation: the few-row
matmuls of decoding through oneDNN instead of MKL), `set_malloc_mmap_threshold` (freed tensors go back to the
system, for a lower peak RSS; `mmap_threshold_raised` lifts it for the rollout's ``generate``, where it only costs
page faults), `fuse_lora` (LoRA layers add their low-rank update into the base layer's output in one pass;
`lora_merged`: the rollout's ``generate`` uses a temporary merged copy of each adapted weight), `fuse_kernels`
(``fused_kernels``: the gated MLPs' ``silu(gate) * up`` and the RMSNorms in one C++ pass forward and one backward)
and `install_tensor_cache` (``tensor_cache``: freed tensor blocks are reused, not zeroed again by the kernel every
step).
All measured in ``make bench-real`` (README, "Benchmarks"; every set in benchmarks/HISTORY.md).

Each decoding step multiplies every weight matrix by one row per sequence. For so few rows, MKL's fp32 GEMM on the
AMD EPYC CPUs measured here (`benchmarks/bench_real.py`) runs at a fraction of the machine's rate: Qwen2.5-0.5B's LM
head (``[151936, 896]``) takes 255 ms for 8 rows, an MLP projection (``[4864, 896]``) 5.1 ms; oneDNN's
``mkldnn_linear`` on the same dense weights takes 84 ms and 2.8 ms. For hundreds of rows (prompt prefill, scoring,
training) MKL is the faster one, so only calls of at most ``max_rows`` rows are rerouted, and only inside the block.

The two libraries sum in different orders: outputs agree to fp32 rounding (about 1e-6 relative), not bit for bit,
so `onednn_decoding` is opt-in (``onednn_decoding: true`` in a PPO recipe) and touches generation only; the
log-probs PPO trains on are computed by the ordinary forward as before.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` through oneDNN: ``x [..., in]``, ``weight [out, in]`` (dense, read in place),
    ``bias [out]`` -> ``[..., out]`` (fp32, CPU). Through ``mkldnn._linear_pointwise``, which takes and gives dense
    tensors, where this PyTorch has it (2.x with oneDNN); else ``mkldnn_linear``, whose input and output are
    converted to and from oneDNN's own tensors (~40-80 us per call, 0.3-0.6 s of a 64-token rollout of 8 rows on
    Qwen2.5-0.5B's 24 layers). The same kernel: the same values, bit for bit."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    if _LINEAR_POINTWISE is not None:
        y = _LINEAR_POINTWISE(x2, weight, bias, "none", [], "")
    else:
        y = torch._C._nn.mkldnn_linear(x2.to_mkldnn(), weight, bias).to_dense()
    return y.reshape(*shape[:-1], weight.shape[0])


# oneDNN's linear on dense tensors (registered by PyTorch builds with oneDNN; a private op, so looked up, not assumed)
_LINEAR_POINTWISE = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None) \
    if torch.backends.mkldnn.is_available() else None


def _eligible(module: nn.Module, min_weight_elements: int) -> bool:
    w = getattr(module, "weight", None)
    # plain nn.Linear only: quantized and other subclasses keep their own forward
    return (type(module) is nn.Linear and w is not None and w.device.type == "cpu" and w.dtype == torch.float32
            and w.numel() >= min_weight_elements)


@contextmanager
def onednn_decoding(model: nn.Module, enabled: bool = True, max_rows: int = 64,
                    min_weight_elements: int = 1 << 18):
    """Inside the block, every fp32 CPU ``nn.Linear`` of ``model`` with at least ``min_weight_elements`` weights
    (default 262,144, 1 MB: Qwen2.5-0.5B's q / o / MLP projections and LM head, not its k / v projections or LoRA
    adapters, for which oneDNN's fixed cost per call outweighs its gain) computes calls of at most ``max_rows`` rows
    (tokens x sequences) made under ``torch.no_grad()`` through oneDNN (`onednn_linear`); other calls and
    everything outside the block are unchanged. A no-op when ``enabled`` is false, when PyTorch was
    built without oneDNN, or for weights that are not fp32 on CPU. Restores every module's own ``forward`` on exit,
    also after an exception. Raises nothing of its own."""
    if not enabled:
        yield model
        return
    if not torch.backends.mkldnn.is_available():
        logger.warning("onednn_decoding: this PyTorch has no oneDNN; decoding uses the default kernels")
        yield model
        return
    patched = []

    def rerouted(module: nn.Linear):
        default = module.forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            rows = x.numel() // max(x.shape[-1], 1)
            if rows > max_rows or torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu":
                return default(x)
            return onednn_linear(x, module.weight, module.bias)

        return forward

    try:
        for module in model.modules():
            if _eligible(module, min_weight_elements) and "forward" not in vars(module):
                module.forward = rerouted(module)
                patched.append(module)
        yield model
    finally:
        for module in patched:
            del module.forward


def set_malloc_mmap_threshold(nbytes: int) -> bool:
    """glibc: serve every allocation of at least ``nbytes`` bytes with its own ``mmap``, returned to the system when
    freed (``mallopt(M_MMAP_THRESHOLD)``; 0: leave glibc's default, a threshold that rises to 32 MB as large blocks
    are freed, below which freed tensors stay in the process's heap). For the process's later allocations; PPO's
    ``malloc_mmap_threshold``. Measured in bench-real (TRL's layout, 8 x 64 tokens): peak RSS 14.9 -> 11.3 GB at
    131072 (128 KB). Returns whether the setting took (False, with a warning, off glibc).

    Raises:
        ValueError: ``nbytes`` is negative.
    """
    if nbytes < 0:
        raise ValueError(f"malloc_mmap_threshold must be >= 0 bytes, got {nbytes}")
    if nbytes == 0:
        return False
    ok = _mallopt_mmap_threshold(nbytes)
    if not ok:
        logger.warning("malloc_mmap_threshold: this C library has no mallopt(M_MMAP_THRESHOLD); setting ignored")
    return ok


def _mallopt_mmap_threshold(nbytes: int) -> bool:
    return _glibc_call("mallopt", -3, int(nbytes))  # M_MMAP_THRESHOLD = -3 (malloc.h)


def _glibc_call(name: str, *args: int) -> bool:
    """``libc.<name>(*args)`` != 0; False where the C library lacks it."""
    import ctypes
    import ctypes.util

    try:
        return bool(getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)(*args))
    except (OSError, AttributeError):
        return False


# bytes: glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
GLIBC_MAX_MMAP_THRESHOLD = 32 << 20


def malloc_trim() -> bool:
    """glibc: hand the heap's free pages back to the system (``malloc_trim(0)``); returns whether any went back
    (False off glibc). Raises nothing."""
    return _glibc_call("malloc_trim", 0)


@contextmanager
def mmap_threshold_raised(nbytes: int, during: int = GLIBC_MAX_MMAP_THRESHOLD):
    """Inside the block glibc's mmap threshold is ``during`` bytes (default 32 MB): a run with
    ``malloc_mmap_threshold: nbytes`` (> 0) wraps its rollout's token-by-token ``generate`` in it, whose many short-
    lived tensors of a few hundred KB then reuse heap blocks instead of being mapped, page-faulted and unmapped at every
    step (bench-real, 8 x 32 tokens: 28.0 s with a 128 KB threshold, 19.1 s with 8 MB). On exit the threshold is
    ``nbytes`` again and `malloc_trim` returns the heap's free pages, so the phases after it start from the same
    footprint. A no-op when ``nbytes`` is 0 (glibc's default threshold is left alone) or off glibc. Raises nothing of
    its own."""
    if nbytes <= 0 or not _mallopt_mmap_threshold(max(nbytes, during)):
        yield
        return
    try:
        yield
    finally:
        _mallopt_mmap_threshold(nbytes)
        malloc_trim()


def _plain_lora(module: nn.Module) -> str | None:
    """The one active adapter's name when ``module`` (a peft ``lora.Linear``) adds a plain ``scaling * B @ A`` (no DoRA
    or other variant, no LoRA bias, no dropout, not merged or disabled) to a base layer with a weight of the adapter's
    dtype; else None. What `_fused_lora_forward` and `lora_merged` take over from peft's forward."""
    names = module.active_adapters
    if module.disable_adapters or module.merged or len(names) != 1:
        return None
    name, weight = names[0], getattr(module.base_layer, "weight", None)
    if name not in module.lora_A or name in getattr(module, "lora_variant", {}) \
            or module.lora_B[name].bias is not None \
            or not isinstance(module.lora_dropout[name], nn.Identity) or weight is None \
            or not (weight.dtype == module.lora_A[name].weight.dtype == module.lora_B[name].weight.dtype):
        return None
    return name


def _fused_lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A peft ``lora.Linear`` forward: ``base(x) + scaling * (x @ A.T) @ B.T`` with the second product added into the
    base layer's output in place (``addmm_``, the scaling as its alpha). peft's own forward (the fallback for every
    case but one plain adapter in one dtype without autocast) forms the product, its scaled copy and the sum: three
    passes over ``[tokens, out_features]`` in the forward and two more in the backward."""
    name = None if args or kwargs or torch.is_autocast_enabled(x.device.type) else _plain_lora(self)
    if name is None or x.dtype != self.base_layer.weight.dtype:
        return type(self).forward(self, x, *args, **kwargs)
    rows = x.reshape(-1, x.shape[-1])  # [tokens, in]: the in-place sum then lands on a tensor, not on a view of one
    result = self.base_layer(rows)  # [tokens, out]
    result.addmm_(nn.functional.linear(rows, self.lora_A[name].weight), self.lora_B[name].weight.t(),
                  alpha=self.scaling[name])
    return result.view(*x.shape[:-1], result.shape[-1])


def fuse_lora(model: nn.Module) -> int:
    """Give every peft ``lora.Linear`` of ``model`` a forward that adds its low-rank update ``(x @ A.T) @ B.T`` into
    the base layer's output ``[..., out_features]`` in one in-place ``addmm_`` (scaling as alpha), instead of peft's
    product, scaled copy and sum (`_fused_lora_forward`; peft's forward still serves a disabled or merged adapter,
    several active adapters, DoRA and other variants, LoRA dropout, LoRA bias, mixed dtypes and autocast). On
    Qwen2.5-0.5B at 8 x 320 tokens peft's LoRA elementwise passes took ~7 of a policy forward + backward's 52 s.
    The same function to fp32 rounding (the scaling is applied inside the GEMM; outputs bit for bit when the scaling
    is a power of two; gradients summed in another order), not bit for bit. Returns the number
    of layers changed; raises nothing of its own."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:  # no peft: no LoRA layers
        return 0
    count = 0
    for module in model.modules():
        if type(module) is LoraLinear:
            module.forward = _fused_lora_forward.__get__(module)
            count += 1
    return count


@contextmanager
def lora_merged(model: nn.Module, enabled: bool = True):
    """Inside the block, every plain peft ``lora.Linear`` of ``model`` (one active adapter: no DoRA or other variant,
    LoRA bias or dropout, on a dense ``nn.Linear`` of the adapter's dtype) computes ``x @ W'.T + bias`` with
    ``W' = W + scaling * B @ A`` ``[out, in]``, a temporary copy: one product per layer instead of three (base,
    ``A``, ``B``), for the rollout's ``generate`` of ``fused_lora``. The base layer's own weight is never written (no
    merge-unmerge drift): on exit, also after an exception, each layer gets its own ``weight`` parameter back and its
    adapter is unmerged in name only. Costs one copy of the adapted weights inside the block (Qwen2.5-0.5B, all seven
    projections: 1.43 GB fp32). Outputs equal peft's to fp32 rounding (the sum ``W + scaling * B @ A`` is rounded
    once before the product), not bit for bit. For no-grad use: nothing trains through ``W'``. A no-op when
    ``enabled`` is false or without peft. Raises nothing of its own."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:
        LoraLinear = None
    swapped = []
    try:
        if enabled and LoraLinear is not None:
            with torch.no_grad():
                for module in model.modules():
                    plain = type(module) is LoraLinear and type(module.base_layer) is nn.Linear \
                        and not module.fan_in_fan_out
                    name = _plain_lora(module) if plain else None
                    if name is None:
                        continue
                    base = module.base_layer
                    weight = base._parameters["weight"]
                    merged = torch.addmm(weight, module.lora_B[name].weight, module.lora_A[name].weight,
                                         alpha=module.scaling[name])
                    base._parameters["weight"] = nn.Parameter(merged, requires_grad=False)
                    swapped.append((module, base, weight, list(module.merged_adapters)))
                    module.merged_adapters = [name]  # peft's forward: base layer alone
        yield model
    finally:
        for module, base, weight, names in swapped:
            base._parameters["weight"] = weight
            module.merged_adapters = names


# -- fused_kernels: the gated MLP's silu(gate) * up and RMSNorm in one pass each (C++, built on first use) ------------
_fused_lib = None  # the loaded kernel library, once `fuse_kernels` has built it
# classes whose forward is down(silu(gate(x)) * up(x)), and weight * (x * rsqrt(mean(x^2) + eps)) (Baichuan's: "MLP",
# "RMSNorm", in its remote code)
MLP_CLASSES = ("Qwen2MLP", "LlamaMLP", "MistralMLP", "Qwen3MLP", "MLP")
RMS_NORM_CLASSES = ("Qwen2RMSNorm", "LlamaRMSNorm", "MistralRMSNorm", "Qwen3RMSNorm", "RMSNorm")


def _cpu_flags_key() -> str:
    """The CPU's feature flags (``/proc/cpuinfo``): a ``-march=native`` build is only reused on the same kind of CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def load_fused_kernels(build_dir: Path | None = None):
    """The kernels of ``rlhf_trl/csrc/fused_kernels.cpp`` built (``-O3 -march=native -fopenmp``, on PyTorch's own
    libgomp, ~1 s once; `_build_library`) and loaded, or None with a warning naming the cause (no compiler or no
    OpenMP, a failed build, not Linux). Cached for the process."""
    import ctypes

    global _fused_lib
    if _fused_lib is not None:
        return _fused_lib
    if not sys.platform.startswith("linux"):
        logger.warning("fused_kernels: Linux only; PyTorch's own operations stay")
        return None
    torch_lib = Path(torch.__file__).parent / "lib"
    try:
        lib = ctypes.CDLL(str(_build_library("fused_kernels", ["-O3", "-march=native", "-fopenmp"],
                                             [f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}"], build_dir,
                                             key_extra=_cpu_flags_key())))
    except (RuntimeError, OSError) as err:
        logger.warning("%s; PyTorch's own operations stay", err)
        return None
    ptr, n = ctypes.c_void_p, ctypes.c_int64
    lib.rlhf_trl_swiglu_forward.argtypes = [ptr, ptr, ptr, n]
    lib.rlhf_trl_swiglu_backward.argtypes = [ptr, ptr, ptr, ptr, ptr, n]
    lib.rlhf_trl_rms_norm_forward.argtypes = [ptr, ptr, ptr, ptr, n, n, ctypes.c_float]
    lib.rlhf_trl_rms_norm_backward.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, n, n]
    _fused_lib = lib
    return lib


def _plain_fp32(*tensors: torch.Tensor) -> bool:
    """The kernels' case: loaded, contiguous fp32 CPU tensors, no autocast."""
    return (_fused_lib is not None and all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                                           for t in tensors) and not torch.is_autocast_enabled("cpu"))


class SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` for contiguous fp32 CPU tensors of one shape ``[..., intermediate]``, forward and backward
    one pass each (`rlhf_trl/csrc/fused_kernels.cpp`). Keeps ``gate`` and ``up`` for the backward (PyTorch's
    silu-then-mul also keeps ``silu(gate)``: one ``[tokens, intermediate]`` tensor less per layer). The same function
    as ``F.silu(gate) * up`` to fp32 rounding (its exp is within 2 ulp), not bit for bit."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(gate)
        _fused_lib.rlhf_trl_swiglu_forward(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad = grad.contiguous()
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        _fused_lib.rlhf_trl_swiglu_backward(grad.data_ptr(), gate.data_ptr(), up.data_ptr(), d_gate.data_ptr(),
                                            d_up.data_ptr(), gate.numel())
        return d_gate, d_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (``[..., intermediate]`` each): `SwiGLU` where the kernels apply (loaded; contiguous fp32
    CPU tensors of one shape; no autocast), else PyTorch's ``F.silu(gate) * up``."""
    if gate.shape == up.shape and _plain_fp32(gate, up):
        return SwiGLU.apply(gate, up)
    return nn.functional.silu(gate) * up


class RMSNorm(torch.autograd.Function):
    """``weight * (x * rsqrt(mean(x^2, -1) + eps))`` for a contiguous fp32 CPU ``x [..., dim]`` and ``weight [dim]``,
    forward and backward one pass per row each (`rlhf_trl/csrc/fused_kernels.cpp`); keeps ``x`` and one ``1 / rms``
    per row for the backward; the weight's gradient only when it trains. The same function as Qwen2's / Llama's
    RMSNorm to fp32 rounding (other summation orders), not bit for bit; the same numbers every run."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dim = x.shape[-1]
        rows = x.numel() // dim
        y, rstd = torch.empty_like(x), x.new_empty(rows)
        _fused_lib.rlhf_trl_rms_norm_forward(x.data_ptr(), weight.data_ptr(), y.data_ptr(), rstd.data_ptr(), rows,
                                             dim, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        grad = grad.contiguous()
        dx = torch.empty_like(x)
        d_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        _fused_lib.rlhf_trl_rms_norm_backward(grad.data_ptr(), x.data_ptr(), weight.data_ptr(), rstd.data_ptr(),
                                              dx.data_ptr(), 0 if d_weight is None else d_weight.data_ptr(),
                                              rstd.numel(), x.shape[-1])
        return dx, d_weight, None


def _fused_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """A gated MLP's forward, ``down(silu(gate(x)) * up(x))``, with the middle as `swiglu`."""
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _fused_rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """An RMSNorm's forward as `RMSNorm` where it applies (else the class's own forward, bit for bit)."""
    if self.weight.shape == x.shape[-1:] and _plain_fp32(x, self.weight):
        return RMSNorm.apply(x, self.weight, self.eps_value)
    return type(self).forward(self, x)


def fuse_kernels(model: nn.Module) -> int:
    """Give every gated SiLU MLP (a module of a class in `MLP_CLASSES` with ``gate_proj``, ``up_proj``, ``down_proj``
    and a SiLU ``act_fn``) and every RMSNorm (`RMS_NORM_CLASSES`, a ``[dim]`` weight and an epsilon) of ``model``
    (Qwen2, Llama, Mistral, Baichuan) a forward through one-pass kernels (`swiglu`, `RMSNorm`): PPO's
    ``fused_kernels``. PyTorch runs ``silu(gate) * up`` as five passes over ``[tokens, intermediate]`` forward and nine
    backward (three and five here) and an RMSNorm as six operations each way (one pass per row here). On
    Qwen2.5-0.5B at 4 x 320 tokens a forward + backward of the body with every weight training takes 7.98 instead of
    8.29 s (the 2-core bench VM, alternating runs). Outputs and gradients equal PyTorch's to fp32 rounding; other
    dtypes, strided inputs and autocast take PyTorch's operations (an RMSNorm: its class's own forward). Returns the
    number of modules changed (0, with a warning, where the kernels cannot be built)."""
    from transformers.activations import SiLUActivation

    def mlp(m):
        return (type(m).__name__ in MLP_CLASSES and isinstance(getattr(m, "act_fn", None), (nn.SiLU, SiLUActivation))
                and all(isinstance(getattr(m, k, None), nn.Module) for k in ("gate_proj", "up_proj", "down_proj")))

    def norm(m):
        w = getattr(m, "weight", None)
        eps = getattr(m, "variance_epsilon", getattr(m, "epsilon", None))
        return (type(m).__name__ in RMS_NORM_CLASSES and isinstance(w, torch.Tensor) and w.dim() == 1
                and isinstance(eps, float) and getattr(m, "bias", None) is None)

    found = [(m, _fused_mlp_forward if mlp(m) else _fused_rms_norm_forward) for m in model.modules()
             if "forward" not in vars(m) and (mlp(m) or norm(m))]
    if not found or load_fused_kernels() is None:
        return 0
    for module, forward in found:
        if forward is _fused_rms_norm_forward:
            module.eps_value = getattr(module, "variance_epsilon", getattr(module, "epsilon", None))
        module.forward = forward.__get__(module)
    return len(found)


# -- tensor_cache: reuse of freed CPU tensor blocks (a small C++ allocator, built on first use) ----------------------
_tensor_cache_lib = None  # the loaded library once installed


def _tensor_cache_build_dir() -> Path:
    return Path(os.environ.get("RLHF_TRL_CACHE", Path.home() / ".cache" / "rlhf_trl")) / "ext"


def _build_library(stem: str, compile_flags: list[str], link_flags: list[str], build_dir: Path | None,
                   key_extra: str = "") -> Path:
    """Compiles ``rlhf_trl/csrc/<stem>.cpp`` into a shared library in ``build_dir`` (default ``~/.cache/rlhf_trl/ext``
    or ``$RLHF_TRL_CACHE/ext``), named by a hash of the source, the flags, the torch version and ``key_extra``, so a
    rebuilt torch (or another CPU, for ``-march=native``) gets a fresh build; reused when present. Written to a
    temporary name and renamed, so concurrent processes never load a half-written file. Returns its path.

    Raises:
        RuntimeError: no C++ compiler (``c++``, ``g++``, ``clang++`` or ``$CXX``), or the build failed (the
            compiler's last output line in the message).
    """
    import hashlib
    import shutil
    import subprocess

    source = Path(__file__).with_name("csrc") / f"{stem}.cpp"
    flags = "|".join(compile_flags + link_flags)
    key = hashlib.sha256(source.read_bytes() + f"{torch.__version__}|{flags}|{key_extra}".encode()).hexdigest()[:16]
    out_dir = Path(build_dir) if build_dir is not None else _tensor_cache_build_dir()
    lib = out_dir / f"{stem}-{key}.so"
    if lib.exists():
        return lib
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise RuntimeError(f"{stem}: no C++ compiler (c++, g++ or clang++; or set CXX) to build {source.name}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{lib.name}.{os.getpid()}.tmp"
    cmd = [cxx, "-std=c++17", "-shared", "-fPIC", *compile_flags, str(source), *link_flags, "-o", str(tmp)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    except OSError as err:  # the compiler named by CXX is not there or cannot run
        done, last = None, str(err)
    if done is None or done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{stem}: building {source.name} with {cxx} failed: {last}")
    os.replace(tmp, lib)
    return lib


def build_tensor_cache(build_dir: Path | None = None) -> Path:
    """Compiles ``rlhf_trl/csrc/tensor_cache.cpp`` against this PyTorch's C++ headers and ``libc10`` (``c++`` or
    ``$CXX``, ~1-2 s) into ``build_dir`` (`_build_library`: default ``~/.cache/rlhf_trl/ext``, or
    ``$RLHF_TRL_CACHE/ext``, keyed by the source, the torch version and its C++ ABI; reused when present). Returns the
    shared library's path.

    Raises:
        RuntimeError: no C++ compiler, or the build failed (the compiler's last output line in the message).
    """
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return _build_library("tensor_cache", ["-O2", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{torch_dir / 'include'}"],
                          [f"-L{torch_dir / 'lib'}", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}"], build_dir)


def install_tensor_cache(headroom_bytes: int = 0, min_bytes: int = 1 << 17, max_unused: float = 0.125) -> bool:
    """Make PyTorch's CPU tensors of at least ``min_bytes`` bytes (default 128 KB) come from a cache of freed blocks
    (`rlhf_trl/csrc/tensor_cache.cpp`, built by `build_tensor_cache`), for the process's later allocations; PPO's
    ``tensor_cache``. A request takes the most recently freed block of the smallest kept size that fits with at most
    ``max_unused`` of it unused (default an eighth: a larger freed block serving a long-lived smaller tensor would
    raise the peak by what it leaves unused). A request none fits is made of the pages of the oldest kept blocks,
    whatever their sizes, moved into its address range (``mremap``: no page is zeroed again; fresh pages only for
    what they do not cover), and then the oldest kept blocks are freed until the live + kept bytes stay within the
    most live bytes seen so far + ``headroom_bytes``: the cache raises the footprint's peak by at most
    ``headroom_bytes``, and one phase's freed blocks (PPO's training activations) become the next phase's tensors (the
    rollout's KV cache, the offloaded reward model's weights) without going back to the system in between.

    Sizes are rounded up to classes (an eighth of their power of two; address space only: the pages past a request
    are never touched), so a tensor that grows a little at a time (the KV cache's ``torch.cat``) reuses one block.

    Why: a training step allocates the same activation shapes every step. glibc maps each large block afresh and
    unmaps it when freed, so the kernel zeroes every activation page again every step: on Qwen2.5-0.5B's value model
    (fp32, 8 x 320 tokens, forward + backward, the 2-core EPYC of bench-real) 21 % of the step in ``clear_page_erms``
    (``perf``); at 4 x 320 tokens 22.7-25.3 s -> 16.1-19.5 s per step with the cache, and bench-real's optimisation
    phase 113.5 -> 77-85 s per update at the same peak RSS. On a VM whose host takes freed pages back (the Intel Xeon
    of bench-real's sixth set), zeroing ran at ~0.5 GB/s and the kept blocks' pages moved into other sizes cut the
    kernel time of an update from 11-15 s to 5 s. The same numbers bit for bit (only where tensors live changes).
    Returns True once installed; False, with a warning naming the cause, where it cannot be (no C++ compiler, a
    failed build, not Linux): the run goes on with PyTorch's own allocator.

    Raises:
        ValueError: a negative ``headroom_bytes`` or ``min_bytes``; ``max_unused`` outside [0, 1).
    """
    import ctypes

    global _tensor_cache_lib
    if headroom_bytes < 0 or min_bytes < 0:
        raise ValueError(f"tensor_cache: headroom ({headroom_bytes}) and min_bytes ({min_bytes}) must be >= 0 bytes")
    if not 0 <= max_unused < 1:
        raise ValueError(f"tensor_cache: max_unused must be in [0, 1), got {max_unused}")
    if not sys.platform.startswith("linux"):
        logger.warning("tensor_cache: Linux only; PyTorch's own CPU allocator stays")
        return False
    try:
        lib = ctypes.CDLL(str(build_tensor_cache()))
    except (RuntimeError, OSError) as err:
        logger.warning("%s; PyTorch's own CPU allocator stays", err)
        return False
    lib.rlhf_trl_tensor_cache_install.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_double]
    lib.rlhf_trl_tensor_cache_release.argtypes = []
    lib.rlhf_trl_tensor_cache_release.restype = ctypes.c_uint64
    lib.rlhf_trl_tensor_cache_uninstall.restype = ctypes.c_uint64
    lib.rlhf_trl_tensor_cache_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
    lib.rlhf_trl_tensor_cache_install(headroom_bytes, min_bytes, max_unused)
    _tensor_cache_lib = lib
    logger.info("tensor_cache: CPU tensors >= %d bytes reuse freed blocks (headroom %d MB)", min_bytes,
                headroom_bytes >> 20)
    return True


def release_tensor_cache() -> int:
    """Free every block the tensor cache keeps (`install_tensor_cache`), back to the system. Returns the bytes freed
    (0 when the cache is not installed). Raises nothing."""
    if _tensor_cache_lib is None:
        return 0
    return int(_tensor_cache_lib.rlhf_trl_tensor_cache_release())


def uninstall_tensor_cache() -> int:
    """Give PyTorch its default CPU allocator back and free the kept blocks (blocks still in use go back to the
    system when their tensors are freed); returns the bytes freed, 0 when not installed.
    Raises nothing."""
    global _tensor_cache_lib
    if _tensor_cache_lib is None:
        return 0
    freed = int(_tensor_cache_lib.rlhf_trl_tensor_cache_uninstall())
    _tensor_cache_lib = None
    return freed


def tensor_cache_installed() -> bool:
    """Whether `install_tensor_cache` has made the cache PyTorch's CPU allocator (and no uninstall since)."""
    return _tensor_cache_lib is not None


def tensor_cache_stats() -> dict[str, int]:
    """The tensor cache's counters: ``kept_bytes`` (freed blocks kept now), ``hits`` / ``misses`` (requests of at
    least ``min_bytes`` served from kept blocks / freshly), ``live_blocks``, ``live_bytes`` and ``peak_live_bytes``
    (blocks handed out, now and at most so far), ``recycled_bytes`` (kept blocks' pages moved into requests no kept
    block served), ``mappings`` (that the live and kept blocks are made of: at most 64 per block, and blocks stay one
    each beyond half of ``vm.max_map_count``); all zero when it is not installed. Raises nothing."""
    import ctypes

    names = ("kept_bytes", "hits", "misses", "live_blocks", "live_bytes", "peak_live_bytes", "recycled_bytes",
             "mappings")
    if _tensor_cache_lib is None:
        return dict.fromkeys(names, 0)
    out = (ctypes.c_uint64 * len(names))()
    _tensor_cache_lib.rlhf_trl_tensor_cache_stats(out)
    return dict(zip(names, (int(v) for v in out)))
