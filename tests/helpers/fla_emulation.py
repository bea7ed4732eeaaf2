"""A CPU emulation of flash-linear-attention's chunked kernels, for testing loongtrain's ``fla`` wrapper
(loongtrain/attn/linear/kernels.py) without a GPU or ``fla`` (docs/testing.md#the-cuda-emulation).

``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` and ``fla.ops.kda.chunk_kda`` are bound to their documented
signatures (``q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
use_qk_l2norm_in_kernel=False, cu_seqlens=None``, keyword arguments as fla names them), then checked the way fla
checks them: ``[B, T, H, K]`` inputs of one dtype (not fp32 for the gated delta rule; fp16/bf16, or fp64 in the
emulation's fp64 mode), ``beta [B, T, H]``, ``g [B, T, H]`` or ``[B, T, H, K]``, with ``cu_seqlens`` a batch of
one and one initial state ``[N, H, K, V]`` per sequence; then computed token by token per sequence in fp32 (fp64
in fp64 mode), differentiably. ``fault`` plants one named bug so tests can show that the check catches it.
"""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager

import torch

Tensor = torch.Tensor

FAULTS = (
    "ignores_initial_state",  # every sequence starts from zero
    "cu_seqlens_shifted",  # pieces cut one token late
    "state_not_decayed",  # the gate is not applied
)


class EmulatedFla:
    """The two kernels (module docstring); ``calls`` records each call's name and ``cu_seqlens`` length."""

    def __init__(self, allow_fp64: bool = False, fault: str | None = None) -> None:
        assert fault is None or fault in FAULTS, fault
        self.allow_fp64, self.fault = allow_fp64, fault
        self.calls: list[tuple[str, int]] = []

    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, head_first=False):
        return self._run("chunk_gated_delta_rule", q, k, v, g, beta, scale, initial_state, output_final_state,
                         use_qk_l2norm_in_kernel, cu_seqlens, per_channel=False)

    def chunk_kda(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                  allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
                  return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                  cp_context=None, use_graph=False, max_num_seqs=None, **kwargs):
        assert not (use_gate_in_kernel or use_beta_sigmoid_in_kernel or state_v_first), "unexpected fused options"
        return self._run("chunk_kda", q, k, v, g, beta, scale, initial_state, output_final_state,
                         use_qk_l2norm_in_kernel, cu_seqlens, per_channel=True)

    def _run(self, op, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, cu_seqlens,
             per_channel):
        dtypes = (torch.float16, torch.bfloat16, *((torch.float64,) if self.allow_fp64 else ()))
        assert q.dtype == k.dtype == v.dtype and q.dtype in dtypes, f"{op}: dtype {q.dtype}"
        batch, seq, heads, key_dim = k.shape
        assert q.shape == k.shape and v.shape[:3] == k.shape[:3], f"{op}: q {q.shape} k {k.shape} v {v.shape}"
        assert beta.shape == (batch, seq, heads), f"{op}: beta must be [B, T, H], got {tuple(beta.shape)}"
        want_g = (batch, seq, heads, key_dim) if per_channel else (batch, seq, heads)
        assert g.shape == want_g, f"{op}: g {tuple(g.shape)}, expected {want_g}"
        bounds = [0, seq] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
        if cu_seqlens is not None:
            assert batch == 1, f"{op}: the batch size is expected to be 1 when using cu_seqlens"
            assert cu_seqlens.dtype in (torch.int32, torch.int64) and bounds[0] == 0 and bounds[-1] == seq
        count = (len(bounds) - 1) * (batch if cu_seqlens is None else 1)
        if initial_state is not None:
            assert initial_state.shape == (count, heads, key_dim, v.shape[-1]), f"{op}: initial state shape"
            assert initial_state.dtype in (torch.float32, torch.float64), f"{op}: initial state {initial_state.dtype}"
        self.calls.append((op, len(bounds)))
        if self.fault == "cu_seqlens_shifted":
            bounds = [bounds[0]] + [min(b + 1, seq) for b in bounds[1:-1]] + [bounds[-1]]
        math = torch.float64 if q.dtype == torch.float64 else torch.float32
        q, k, v, g, beta = (x.to(math) for x in (q, k, v, g, beta))
        if l2norm:
            q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
        scale = key_dim ** -0.5 if scale is None else scale
        outs, finals = [], []
        for b in range(batch):
            for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
                n = b * (len(bounds) - 1) + i
                given = initial_state is not None and self.fault != "ignores_initial_state"
                state = initial_state[n].to(math) if given else torch.zeros(heads, key_dim, v.shape[-1], dtype=math)
                for t in range(s, e):
                    decay = g[b, t].exp()
                    if self.fault != "state_not_decayed":
                        state = state * (decay[..., None] if per_channel else decay[:, None, None])
                    written = beta[b, t, :, None] * (v[b, t] - torch.einsum("hk,hkv->hv", k[b, t], state))
                    state = state + k[b, t, :, :, None] * written[:, None, :]
                    outs.append(torch.einsum("hk,hkv->hv", q[b, t] * scale, state))
                finals.append(state)
        out = torch.stack(outs).reshape(batch, seq, heads, -1).to(v.dtype)
        return out, (torch.stack(finals) if output_final_state else None)


@contextmanager
def emulated_fla(emulation: EmulatedFla):
    """``fla.ops.gated_delta_rule`` and ``fla.ops.kda`` importable as the emulation's kernels while inside."""
    names = ("fla", "fla.ops", "fla.ops.gated_delta_rule", "fla.ops.kda")
    saved = {name: sys.modules.get(name) for name in names}
    modules = {name: types.ModuleType(name) for name in names}
    modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = emulation.chunk_gated_delta_rule
    modules["fla.ops.kda"].chunk_kda = emulation.chunk_kda
    sys.modules.update(modules)
    try:
        yield emulation
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module

