"""One-shot device check of the GPU path: kernel exactness, the ring on the GPU, attention TFLOP/s, training.

    PYTHONPATH=. python3 benchmarks/gpu_check.py                 # one GPU, a few minutes
    PYTHONPATH=. python3 benchmarks/gpu_check.py --cpu           # tiny sizes on CPU (tests/test_gpu_check.py)

Sections (each prints a summary and is written to ``--out`` JSON as soon as it is done, so a run cut
short still reports what it measured; a section that fails records its error and the next one runs):

- ``kernels``: every candidate kernel's forward (out, lse) and gradients in bf16 and fp16 against fp64
  autograd through the reference kernel (max abs error per tensor), and the kernel the ring chooses
  (``loongtrain.attn.kernel_choice.choose_kernel``: measured when several qualify).
- ``ring``: the in-process ring (``loongtrain.attn.ring.local_ring_forward/backward``: every member in
  this process, the distributed executor's schedule, transfers as hand-offs) on zigzag shards for
  ``cp`` = 2, 4, 8 (double-ring windows included) and head splits emulated by slicing heads per head
  rank (GQA, ``hp`` > ``num_kv_heads`` replicating KV heads, their gradients summed back). Per tensor:
  the error against fp64 divided by the unsharded kernel's own error (``ratio``; 1 = the sharding adds
  nothing), and the difference to the unsharded kernel.
- ``documents``: packed documents (and documents with a sliding window) through the in-process ring for
  cp = 2, 4, 8 (on CUDA the flash kernel packs a step's pieces into varlen calls), error ratios as in
  ``ring``, and the masked call's time against full causal at the same S beside the visible fraction.
- ``determinism``: the attention backward run twice on the same inputs, bitwise equal or not, without
  and with ``torch.use_deterministic_algorithms(True)``, and the deterministic slowdown.
- ``throughput``: forward+backward TFLOP/s of causal attention, D=128, against the device's dense bf16
  peak (FLOPs: forward ``2 * S^2 * H * D`` causal, backward 2.5x forward, FlashAttention's convention);
  each kernel candidate is timed at the shortest length; the points use the ring's choice.
- ``kernel_choice``, ``loss``, ``compile`` (``benchmarks/gpu_speed.py``): each candidate kernel's forward
  and backward time on dense calls and on packed documents beside the kernel chosen; the fused chunked
  loss against the unchunked one; eager against compiled training (tokens/s, MFU, warm-up, graphs).
- ``training``: ``Trainer`` on one device under Selective Checkpoint++ at the longest sequence the
  planner says fits (halved on out-of-memory), and at 64K when that is shorter: tokens/s, MFU (model
  FLOPs, loongtrain.train.metrics), peak allocated memory after set-up against
  ``loongtrain.plan.memory_model.memory_per_rank``.
- ``offload``: ``benchmarks/offload.py``'s modes (activation offload, tiled MLP, parameter offload) on
  1b at the longest of 256K/128K/64K tokens that runs: each mode's step time against its baseline timed
  right before it, tokens/s, peak allocated memory of both, bytes offloaded per step.

On one H200 the sections before ``offload`` are meant to take at most 8 minutes together (``--budget-s``
bounds the training section; ``--sections`` picks sections).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_speed import SPEED_SECTIONS, SPEED_SIZES  # noqa: E402
from loongtrain.attn.kernel_choice import choose_kernel, kernel_candidates  # noqa: E402
from loongtrain.attn.kernel_timing import median_seconds  # noqa: E402
from loongtrain.attn.kernels import REFERENCE, Kernel  # noqa: E402
from loongtrain.attn.masking import AttnMask, dense_mask  # noqa: E402
from loongtrain.attn.ring import local_ring_backward, local_ring_forward  # noqa: E402
from loongtrain.parallel.documents import visible_pairs  # noqa: E402
from loongtrain.parallel.zigzag import shard_indices  # noqa: E402
from loongtrain.plan.document_work import lognormal_documents  # noqa: E402

Tensor = torch.Tensor

SIZES: dict[str, dict[str, Any]] = {
    "gpu": {"exact": (1, 4096, 8, 2, 128), "ring_seq": 8192, "ring_heads": (8, 2, 128),
            "tput_seqs": (16384, 65536, 131072), "tput_heads": (32, 8), "det_seq": 8192,
            "models": ("1b", "7b-gqa"), "train_seqs": (131072, 98304, 65536, 49152, 32768, 16384, 8192),
            "train_mid": 65536, "steps": 3, "offload": ("1b", (262144, 131072, 65536), 2, None)},
    "cpu": {"exact": (1, 256, 4, 2, 32), "ring_seq": 256, "ring_heads": (4, 2, 32),
            "tput_seqs": (512, 1024), "tput_heads": (4, 2), "det_seq": 256,
            "models": ("tiny",), "train_seqs": (1024, 512), "train_mid": 512, "steps": 2,
            "offload": ("cpu-small", (128,), 1,
                        ("offload activations + mlp tiles auto", "offload params (zero full)"))},
}
RING_CASES = ((1, 2, 1), (1, 4, 1), (1, 4, 2), (1, 8, 1), (1, 8, 4), (2, 4, 2), (4, 2, 1))  # (hp, cp, window)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32, device="cpu").to(device=device, dtype=dtype)


def _bshd(b: int, s: int, h: int, d: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> Tensor:
    """A ``[B, H, S, D]`` transposed view of a ``[B, S, H, D]`` tensor (the model's layout)."""
    return _randn((b, s, h, d), dtype, device, gen).transpose(1, 2)


def _max_err(got: Tensor, ref: Tensor) -> float:
    return float((got.double() - ref.double()).abs().max())


def reference64(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, scale: float,
                mask: AttnMask | None = None) -> dict[str, Tensor]:
    """out, lse, dq, dk, dv of causal attention (or under ``mask``: documents, window) in fp64 (autograd
    through the reference kernel)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    if mask is None:
        out, lse = REFERENCE.forward(q64, k64, v64, True, scale)
    else:
        out, lse = REFERENCE.forward(q64, k64, v64, False, scale, dense_mask(q.shape[2], mask).to(q.device))
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    return {"out": out.detach(), "lse": lse.detach(), "dq": dq, "dk": dk, "dv": dv}


def run_kernel(kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, scale: float) -> dict[str, Tensor]:
    out, lse = kernel.forward(q, k, v, True, scale)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, True, scale)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def check_kernels(device: torch.device, size: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    b, s, h, hkv, d = size["exact"]
    out: dict[str, Any] = {"shape": {"B": b, "S": s, "H": h, "Hkv": hkv, "D": d}}
    for dtype in (torch.bfloat16, torch.float16):
        gen = torch.Generator().manual_seed(0)
        q, dout = (_bshd(b, s, h, d, dtype, device, gen) for _ in range(2))
        k, v = (_bshd(b, s, hkv, d, dtype, device, gen) for _ in range(2))
        kernel = choose_kernel(device, dtype, d, h, hkv, s)
        ref = reference64(q, k, v, dout, d ** -0.5)
        errs: dict[str, Any] = {}
        for cand in kernel_candidates(device, dtype, d):
            try:
                got = run_kernel(cand, q, k, v, dout, d ** -0.5)
                errs[cand.name] = {name: _max_err(got[name], ref[name]) for name in ref}
            except Exception as exc:  # noqa: BLE001 - report a candidate that cannot run, keep going
                errs[cand.name] = f"error: {type(exc).__name__}: {exc}"[:300]
        out[str(dtype).replace("torch.", "")] = {"kernel": kernel.name, "max_abs_err": errs[kernel.name],
                                                  "candidates": errs}
    return out


def _zigzag(x: Tensor, cp: int, rank: int) -> Tensor:
    """Member ``rank``'s ``[B, H, S_c, D]`` shard (a view) of a ``[B, H, S, D]`` tensor."""
    return x.transpose(1, 2)[:, shard_indices(x.shape[2], 1, cp, rank, 0).to(x.device)].transpose(1, 2)


def _head_slice(num_heads: int, num_kv_heads: int, hp: int, j: int) -> tuple[slice, slice]:
    """Query and KV heads of head rank ``j`` (docs/design.md §5: KV heads split, or replicated)."""
    hq = num_heads // hp
    if num_kv_heads >= hp:
        hk = num_kv_heads // hp
        return slice(j * hq, (j + 1) * hq), slice(j * hk, (j + 1) * hk)
    kv = j // (hp // num_kv_heads)
    return slice(j * hq, (j + 1) * hq), slice(kv, kv + 1)


def sharded_attention(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, hp: int, cp: int, window: int,
                      scale: float, kernel: Kernel | None = None, mask: AttnMask | None = None) -> dict[str, Tensor]:
    """out, dq, dk, dv of causal attention (or under ``mask``) over ``hp`` head ranks x a ``cp`` ring, all
    in this process."""
    seq = q.shape[2]
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32  # dK/dV sum over head ranks
    res = {"out": torch.empty_like(q), "dq": torch.empty_like(q),
           "dk": torch.zeros(k.shape, dtype=acc, device=k.device),
           "dv": torch.zeros(v.shape, dtype=acc, device=v.device)}
    for j in range(hp):
        hq, hk = _head_slice(q.shape[1], k.shape[1], hp, j)
        qs, ks, vs, douts = ([_zigzag(t[:, heads], cp, r) for r in range(cp)]
                             for t, heads in ((q, hq), (k, hk), (v, hk), (dout, hq)))
        fwd = local_ring_forward(qs, ks, vs, window, True, scale, kernel, mask=mask)
        outs, lses = [o for o, _ in fwd], [lse for _, lse in fwd]
        bwd = local_ring_backward(douts, qs, ks, vs, outs, lses, window, True, scale, kernel, mask=mask)
        for r in range(cp):
            idx = shard_indices(seq, 1, cp, r, 0).to(q.device)
            res["out"][:, hq, idx] = outs[r]
            res["dq"][:, hq, idx] = bwd[r][0]
            res["dk"][:, hk, idx] += bwd[r][1].to(acc)  # replicated KV heads: sum over head ranks
            res["dv"][:, hk, idx] += bwd[r][2].to(acc)
    res["dk"], res["dv"] = res["dk"].to(k.dtype), res["dv"].to(v.dtype)
    return res


def check_ring(device: torch.device, size: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    h, hkv, d = size["ring_heads"]
    s = size["ring_seq"]
    out: dict[str, Any] = {"shape": {"B": 1, "S": s, "H": h, "Hkv": hkv, "D": d}, "cases": []}
    worst = 0.0
    for dtype in (torch.bfloat16, torch.float16):
        gen = torch.Generator().manual_seed(1)
        q, dout = (_bshd(1, s, h, d, dtype, device, gen) for _ in range(2))
        k, v = (_bshd(1, s, hkv, d, dtype, device, gen) for _ in range(2))
        ref = reference64(q, k, v, dout, d ** -0.5)
        kernel = choose_kernel(device, dtype, d, h, hkv, s)
        base = run_kernel(kernel, q, k, v, dout, d ** -0.5)
        base_err = {n: _max_err(base[n], ref[n]) for n in ("out", "dq", "dk", "dv")}
        for hp, cp, window in RING_CASES:
            got = sharded_attention(q, k, v, dout, hp, cp, window, d ** -0.5, kernel)
            case = {"dtype": str(dtype).replace("torch.", ""), "hp": hp, "cp": cp, "window": window,
                    "kernel": kernel.name, "ratio": {}, "vs_kernel": {}}
            for n in base_err:
                err = _max_err(got[n], ref[n])
                case["ratio"][n] = err / base_err[n] if base_err[n] > 0 else float("inf") * (err > 0)
                case["vs_kernel"][n] = _max_err(got[n], base[n])
            worst = max(worst, *case["ratio"].values())
            out["cases"].append(case)
        out[f"kernel_err_{str(dtype).replace('torch.', '')}"] = base_err
    out["worst_ratio"] = worst
    return out


def check_documents(device: torch.device, size: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """Packed documents (lognormal, median S/16) and documents with a window S/8 through the in-process
    ring (on CUDA the flash kernel packs a step's pieces into varlen calls): error against fp64 over the
    unsharded kernel path's own error (cp=1: the same pieces in one process), and the time of the
    masked call against full causal attention at the same S (it should track the visible fraction)."""
    h, hkv, d = size["ring_heads"]
    s = size["ring_seq"]
    docs = tuple(lognormal_documents(s, max(1, s // 16)))
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(4)
    q, dout = (_bshd(1, s, h, d, dtype, device, gen) for _ in range(2))
    k, v = (_bshd(1, s, hkv, d, dtype, device, gen) for _ in range(2))
    kernel = choose_kernel(device, dtype, d, h, hkv, s)
    out: dict[str, Any] = {"S": s, "H": h, "Hkv": hkv, "D": d, "documents": len(docs) - 1, "kernel": kernel.name,
                           "cases": [], "worst_ratio": 0.0}
    scale = d ** -0.5
    unsharded = functools.partial(sharded_attention, q, k, v, dout, 1, 1, 1, scale, kernel)  # cp=1: one process
    causal_s = median_seconds(unsharded, device, 3)
    for window in (None, s // 8):
        mask = AttnMask(True, window, (docs,))
        ref = reference64(q, k, v, dout, scale, mask)
        base = unsharded(mask=mask)
        base_err = {n: _max_err(base[n], ref[n]) for n in base}
        for cp in (2, 4, 8):
            got = sharded_attention(q, k, v, dout, 1, cp, 1, scale, kernel, mask)
            ratio = {n: _max_err(got[n], ref[n]) / base_err[n] if base_err[n] > 0 else 1.0 for n in got}
            out["cases"].append({"window": window, "cp": cp, "ratio": ratio, "kernel_err": base_err})
            out["worst_ratio"] = max(out["worst_ratio"], *ratio.values())
        visible = visible_pairs(list(docs), s, sliding_window=window) / visible_pairs(None, s)
        masked_s = median_seconds(functools.partial(unsharded, mask=mask), device, 3)
        out[f"timing_window_{window}"] = {"visible_fraction": visible, "masked_s": masked_s, "causal_s": causal_s,
                                          "speedup": causal_s / masked_s, "ideal_speedup": 1 / visible}
    return out


def _fwd_bwd(kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, dout: Tensor) -> Callable[[], Any]:
    scale = q.shape[-1] ** -0.5

    def fn() -> Any:
        out, lse = kernel.forward(q, k, v, True, scale)
        return kernel.backward(dout, q, k, v, out, lse, True, scale)

    return fn


def device_peak(device: torch.device) -> float:
    """Dense bf16 peak TFLOP/s (by device name on CUDA; measured fp32 matmul on CPU)."""
    from loongtrain.train.metrics import cuda_peak_tflops, measure_cpu_tflops

    if device.type == "cuda":
        return cuda_peak_tflops(device) or float("nan")
    return measure_cpu_tflops()


def check_throughput(device: torch.device, size: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    h, hkv = size["tput_heads"]
    d = 128 if device.type == "cuda" else 32
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = device_peak(device)
    out: dict[str, Any] = {"peak_tflops": peak, "H": h, "Hkv": hkv, "D": d, "dtype": str(dtype), "points": [],
                           "candidates": {}}
    gen = torch.Generator().manual_seed(2)
    for i, s in enumerate(size["tput_seqs"]):
        q, dout = (_bshd(1, s, h, d, dtype, device, gen) for _ in range(2))
        k, v = (_bshd(1, s, hkv, d, dtype, device, gen) for _ in range(2))
        if i == 0:  # every candidate at the shortest length (choose_kernel measures at most 8K tokens)
            for cand in kernel_candidates(device, dtype, d):
                try:
                    out["candidates"][cand.name] = median_seconds(_fwd_bwd(cand, q, k, v, dout), device, 3)
                except Exception as exc:  # noqa: BLE001 - report a candidate that cannot run, keep going
                    out["candidates"][cand.name] = f"error: {type(exc).__name__}: {exc}"[:300]
        kernel = choose_kernel(device, dtype, d, h, hkv, s)
        seconds = median_seconds(_fwd_bwd(kernel, q, k, v, dout), device, 3 if s < 100_000 else 2)
        flops = 2 * s * s * h * d * (1 + 2.5)  # causal forward 2*S^2*H*D; backward 2.5x
        tflops = flops / seconds / 1e12
        out["points"].append({"S": s, "kernel": kernel.name, "seconds": seconds, "tflops": tflops,
                              "fraction_of_peak": tflops / peak})
        del q, k, v, dout
    return out


def check_determinism(device: torch.device, size: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    s, d = size["det_seq"], (128 if device.type == "cuda" else 32)
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    q, dout = (_bshd(1, s, 8, d, dtype, device, gen) for _ in range(2))
    k, v = (_bshd(1, s, 2, d, dtype, device, gen) for _ in range(2))
    out: dict[str, Any] = {"S": s}
    before = torch.are_deterministic_algorithms_enabled()
    try:
        for flag in (False, True):
            key = "deterministic" if flag else "default"
            try:
                torch.use_deterministic_algorithms(flag)
                kernel = choose_kernel(device, dtype, d, 8, 2, s)  # deterministic mode: the rule's kernel
                fn = _fwd_bwd(kernel, q, k, v, dout)
                runs = [fn() for _ in range(3)]
                equal = all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r))
                out[key] = {"kernel": kernel.name, "bitwise_equal": equal, "seconds": median_seconds(fn, device, 3)}
            except Exception as exc:  # noqa: BLE001 - e.g. an op without a deterministic version
                out[key] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    finally:
        torch.use_deterministic_algorithms(before)
    if "seconds" in out["default"] and "seconds" in out["deterministic"]:
        out["slowdown"] = out["deterministic"]["seconds"] / out["default"]["seconds"]
    return out


def _train_one(name: str, seq: int, device: torch.device, steps: int) -> dict[str, Any]:
    from loongtrain.data.synthetic import global_batch
    from loongtrain.model.config import flops_per_token, get_preset
    from loongtrain.parallel.config import ParallelConfig
    from loongtrain.parallel.mesh import single_process_mesh
    from loongtrain.plan.memory_model import memory_per_rank
    from loongtrain.train.config import Run, TrainConfig, autocast_dtype, param_dtype
    from loongtrain.train.trainer import Trainer

    model_config = get_preset(name)
    cfg = TrainConfig(model=name, seq_len=seq, steps=steps + 1, warmup=1, dtype="auto",
                      parallel=ParallelConfig(ac_mode="selective"), memory_report=False)
    mesh = single_process_mesh()
    trainer = Trainer(Run(cfg, model_config), mesh, device)
    compute = autocast_dtype(cfg, device) or param_dtype(cfg)
    predicted = memory_per_rank(model_config, mesh.layout, seq_len=seq, batch=1, zero_size=1,
                                ac_mode="selective", dtype_bytes=torch.empty((), dtype=compute).element_size())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for step in range(steps):
        batch = global_batch(step, 1, seq, model_config.vocab_size, seed=0)
        _sync(device)
        t0 = time.perf_counter()
        losses.append(trainer.step([batch])["loss"])
        _sync(device)
        times.append(time.perf_counter() - t0)
    timed = times[1:] or times
    dt = sum(timed) / len(timed)
    peak = device_peak(device)
    achieved = flops_per_token(model_config, seq) * seq / dt / 1e12
    result = {"model": name, "seq_len": seq, "ac_mode": "selective", "compute_dtype": str(compute),
              "kernel": choose_kernel(device, compute, model_config.head_dim, model_config.num_heads,
                                      model_config.num_kv_heads, seq).name,
              "step_s": timed, "tokens_per_s": seq / dt, "model_tflops": achieved, "mfu": achieved / peak,
              "losses": losses, "predicted_gib": {k: v / 2**30 for k, v in predicted.items()}}
    if device.type == "cuda":
        measured = torch.cuda.max_memory_allocated(device)
        result.update(peak_allocated_gib=measured / 2**30,
                      peak_reserved_gib=torch.cuda.max_memory_reserved(device) / 2**30,
                      predicted_over_measured=predicted["total"] / measured)
    return result


def check_training(device: torch.device, size: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    from loongtrain.model.config import get_preset
    from loongtrain.parallel.layout import Layout
    from loongtrain.plan.memory_model import memory_per_rank

    capacity = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else 8 * 2**30
    out: dict[str, Any] = {"capacity_gib": capacity / 2**30, "runs": [], "skipped": []}
    deadline = state["deadline"]
    state["partial"] = out  # written after every run, so a run cut short keeps the finished ones
    for i, name in enumerate(size["models"]):
        if i > 0 and time.monotonic() > deadline - 100:
            out["skipped"].append(f"{name}: out of time (--budget-s)")
            continue
        config = get_preset(name)
        fits = [s for s in size["train_seqs"]
                if memory_per_rank(config, Layout(1, 1, 1), seq_len=s, batch=1, zero_size=1,
                                   ac_mode="selective")["total"] <= 0.92 * capacity]
        for seq in fits:
            try:
                out["runs"].append(_train_one(name, seq, device, size["steps"]))
                state["flush"]()
                mid = size["train_mid"]
                if mid in fits and mid < seq and time.monotonic() < deadline - 100:  # also at 64K
                    out["runs"].append(_train_one(name, mid, device, size["steps"]))
                    state["flush"]()
                break
            except torch.OutOfMemoryError as exc:
                out["skipped"].append(f"{name} S={seq}: out of memory ({str(exc)[:160]})")
            finally:
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if time.monotonic() > deadline - 60:
                break
        else:
            if not fits:
                out["skipped"].append(f"{name}: the planner fits no tried length in {capacity / 2**30:.0f} GiB")
    return out


def check_offload(device: torch.device, size: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """benchmarks/offload.py's side-by-side step times of the memory modes (Selective Checkpoint++ beside
    each) at the first length that runs without running out of memory, on a one-rank process group."""
    import torch.distributed as dist

    from benchmarks.offload import MODES, compare_modes
    from loongtrain.model.config import ModelConfig, get_preset

    name, seqs, rounds, names = size["offload"]
    modes = {n: MODES[n] for n in names} if names else MODES
    model = ModelConfig(vocab_size=128, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64) \
        if name == "cpu-small" else get_preset(name)
    out: dict[str, Any] = {"model": name, "skipped": []}
    owns = not dist.is_initialized()
    if owns:
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        for seq in seqs:
            try:
                out["modes"] = compare_modes(model, seq, device, rounds=rounds, modes=modes)
                out["seq_len"] = seq
                for r in out["modes"].values():
                    r["tokens_per_s"], r["baseline_tokens_per_s"] = seq / r["mode_s"], seq / r["baseline_s"]
                break
            except torch.OutOfMemoryError as exc:
                out["skipped"].append(f"S={seq}: out of memory ({str(exc)[:160]})")
            finally:
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        if owns:
            dist.destroy_process_group()
    return out


SECTIONS = (("kernels", check_kernels), ("ring", check_ring), ("documents", check_documents),
            ("determinism", check_determinism), ("throughput", check_throughput), *SPEED_SECTIONS,
            ("training", check_training), ("offload", check_offload))


def environment(device: torch.device) -> dict[str, Any]:
    env = {"torch": torch.__version__, "device": str(device), "python": sys.version.split()[0]}
    if device.type == "cuda":
        env.update(name=torch.cuda.get_device_name(device), capability=list(torch.cuda.get_device_capability(device)),
                   cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    env["kernels"] = {str(dt): [k.name for k in kernel_candidates(device, dt, 128)]
                      for dt in (torch.bfloat16, torch.float16, torch.float32)}
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny sizes on CPU (the test of this script)")
    parser.add_argument("--out", default="benchmarks/gpu_check.json", help="JSON output path")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip later models past this wall time")
    parser.add_argument("--sections", default=",".join(n for n, _ in SECTIONS), help="comma-separated sections")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: pass --cpu for the tiny CPU run")
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    size = {**SIZES["cpu" if args.cpu else "gpu"], **SPEED_SIZES["cpu" if args.cpu else "gpu"]}
    state: dict[str, Any] = {"deadline": time.monotonic() + args.budget_s}
    results: dict[str, Any] = {"command": " ".join(["python3 benchmarks/gpu_check.py", *(argv or sys.argv[1:])]),
                               "environment": environment(device)}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    wanted = args.sections.split(",")
    def flush() -> None:
        out_path.write_text(json.dumps({**results, "partial": state.get("partial")}, indent=1, default=str))

    state["flush"] = flush
    for name, fn in SECTIONS:
        if name not in wanted:
            continue
        t0 = time.perf_counter()
        state["partial"] = None
        try:
            results[name] = fn(device, size, state)
        except Exception:  # noqa: BLE001 - record it and run the next section
            results[name] = {"error": traceback.format_exc()[-2000:]}
        results[name]["wall_s"] = time.perf_counter() - t0
        print(f"== {name} ({results[name]['wall_s']:.1f} s)\n{json.dumps(results[name], indent=1, default=str)}",
              flush=True)
        state["partial"] = None
        flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
