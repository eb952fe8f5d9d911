"""PPO's three CPU measures, all opt-in recipe keys: `onednn_decoding` (faster token-by-token generation: the few-row
matmuls of decoding through oneDNN instead of MKL), `set_malloc_mmap_threshold` (freed tensors go back to the
system, for a lower peak RSS; `mmap_threshold_raised` lifts it for the rollout's ``generate``, where it only costs
page faults) and `fuse_lora` (LoRA layers add their low-rank update into the base layer's output in one pass).
All measured in ``make bench-real`` (README, "Real weights").

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
from contextlib import contextmanager

import torch
from torch import nn

logger = logging.getLogger(__name__)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` through oneDNN: ``x [..., in]``, ``weight [out, in]`` (dense, read in place),
    ``bias [out]`` -> ``[..., out]`` (fp32, CPU)."""
    shape = x.shape
    y = torch._C._nn.mkldnn_linear(x.reshape(-1, shape[-1]).contiguous().to_mkldnn(), weight, bias)
    return y.to_dense().reshape(*shape[:-1], weight.shape[0])


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


GLIBC_MAX_MMAP_THRESHOLD = 32 << 20  # bytes: glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)


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


def _fused_lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A peft ``lora.Linear`` forward: ``base(x) + scaling * (x @ A.T) @ B.T`` with the second product added into the
    base layer's output in place (``addmm_``, the scaling as its alpha). peft's own forward (the fallback for every
    case but one plain adapter in one dtype without autocast) forms the product, its scaled copy and the sum: three
    passes over ``[tokens, out_features]`` in the forward and two more in the backward."""
    names = self.active_adapters
    if args or kwargs or self.disable_adapters or self.merged or len(names) != 1 or \
            torch.is_autocast_enabled(x.device.type):
        return type(self).forward(self, x, *args, **kwargs)
    name = names[0]
    base_weight = getattr(self.base_layer, "weight", None)
    if name not in self.lora_A or name in getattr(self, "lora_variant", {}) or self.lora_B[name].bias is not None \
            or not isinstance(self.lora_dropout[name], nn.Identity) or base_weight is None \
            or not (x.dtype == base_weight.dtype == self.lora_A[name].weight.dtype == self.lora_B[name].weight.dtype):
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
