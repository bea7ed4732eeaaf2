"""``--compile off|on``: ``torch.compile`` of each decoder block (docs/compile.md).

:func:`compile_blocks` is the compile step of :func:`loongtrain.parallelize.compose.parallelize`, after
recompute and before FSDP2: each block's ``forward`` (already the checkpointed one, if any) is
replaced on the instance by a compiled one, so FSDP2's gather/reshard hooks stay eager around it, parameter
names are unchanged, and selective recompute's policy is traced with the block (the compiler saves the
outputs of the attention ops and recomputes the rest, as in eager). 2D-Attention's communication and ring
run inside the ``torch.ops.loongtrain.*`` custom ops, which stay opaque to the compiler (their fake
implementations give the output shapes); the block compiles to one graph.

Document boundaries (``cu_seqlens``) and the chunk order reach the compiled block as CPU int64 tensors
(:func:`block_inputs`; the boundaries' lengths marked dynamic), never as Python ints: a new document mix or
balanced layout is new data for the same graph, not a new graph. A block compiles at most twice: for its
first inputs, and once more if a batch without documents follows batches with them (or the reverse).

Off by default: ``--compile on`` compiles on CUDA and on CPU alike.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loongtrain.parallel.config import COMPILE_MODES
from loongtrain.parallelize.compile_errors import (
    CompileError,
    compile_failure,
    enter_forward,
    from_compiler,
    mark_backward,
    missing_compiler,
)

log = logging.getLogger("loongtrain.train")


#: torch.compile backend of the compile step (tests use "aot_eager": the same graphs, no code generation)
BACKEND = "inductor"

_MASK_ARGS = ("cu_seqlens", "chunk_order")


def compile_enabled(mode: str, device: torch.device) -> bool:
    """Whether ``--compile mode`` compiles on ``device`` (module docstring); ValueError for an unknown mode."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"--compile={mode!r} is not one of {COMPILE_MODES}")
    return mode == "on"


def check_compile_backend(mode: str, device_type: str) -> None:
    """Launcher validation: ValueError naming the missing piece if ``--compile mode`` would compile on
    ``device_type`` and torch cannot (:func:`missing_compiler`)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"--compile={mode!r} is not one of {COMPILE_MODES}")
    if mode != "on":
        return
    missing = missing_compiler(device_type, BACKEND)
    if missing is not None:
        raise ValueError(f"--compile {mode}: {missing}; run with --compile off")


def check_compile_options(parallel: Any) -> None:
    """ValueError unless the memory modes of ``parallel`` (a ParallelConfig) compose with compiled blocks:
    activation offload (saved-tensor hooks around each block) and MLP tiles (a Python autograd Function per
    tile) have not been verified under torch.compile, so they run eager only."""
    if parallel.offload_activations:
        raise ValueError("--compile on with --offload-activations is not supported yet: use --compile off")
    if str(parallel.mlp_tiles) != "1":
        raise ValueError(f"--compile on with --mlp-tiles {parallel.mlp_tiles} is not supported yet: use "
                         f"--compile off or --mlp-tiles 1")


def check_compile_run(mode: str, parallel: Any, device_type: str) -> None:
    """The launcher's check of ``--compile`` (before any worker starts): :func:`check_compile_backend`, and
    when it compiles, :func:`check_compile_options`."""
    check_compile_backend(mode, device_type)
    if mode == "on":
        check_compile_options(parallel)


def block_inputs(signature: inspect.Signature, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    """``args, kwargs`` of a block call with ``cu_seqlens`` (a list of per-row CPU int64 tensors, lengths
    marked dynamic) and ``chunk_order`` (one CPU int64 tensor) as tensors, wherever they are passed
    (positionally, by name, or inside ``**kwargs`` as transformers' layers take them)."""
    bound = signature.bind_partial(*args, **kwargs)
    params = signature.parameters
    extra = next((n for n, p in params.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    for name in _MASK_ARGS:
        holder = bound.arguments
        if name not in holder and extra is not None and name in holder.get(extra, {}):
            holder = holder[extra]
        if holder.get(name) is not None:
            holder[name] = _as_tensors(name, holder[name])
    return bound.args, bound.kwargs


def _as_tensors(name: str, value: Any) -> Any:
    if name == "chunk_order":
        return (value if isinstance(value, torch.Tensor) else torch.tensor(list(value))).to("cpu", torch.int64)
    single = isinstance(value, torch.Tensor) and value.dim() == 1
    if not single and value and all(isinstance(x, int) for x in value):
        single = True
    rows = [value] if single else list(value)
    out = []
    for row in rows:
        t = (row if isinstance(row, torch.Tensor) else torch.tensor(list(row))).to("cpu", torch.int64)
        torch._dynamo.maybe_mark_dynamic(t, 0)
        out.append(t)
    return out


def _checkpoint_side_effects() -> Any:
    """While a block traces: a Python side effect in a checkpointed forward is not replayed in its recompute,
    instead of ending the graph there. transformers' layers (``use_kernelized_func``, ``kernels``) set and
    reset a module-level variable in ``forward``; under full recompute that break made every Hugging Face
    block run eagerly, compiling nothing. The variable is restored before the forward returns, so the
    recompute needs none of it (the gradients equal eager's: tests/unit/test_compile.py)."""
    config = torch._dynamo.config
    if not hasattr(config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        return contextlib.nullcontext()
    return config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)



def compile_block(block: nn.Module, name: str, backend: str | None = None) -> None:
    """Replace ``block.forward`` by its compiled version (module docstring)."""
    forward = block.forward
    original = block.__dict__.get("_loongtrain_forward", forward)
    signature = inspect.signature(original)
    compiled = torch.compile(forward, backend=backend or BACKEND)

    def run(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = block_inputs(signature, args, kwargs)
        enter_forward(name)
        try:
            with _checkpoint_side_effects():
                out = compiled(*args, **kwargs)
        except Exception as exc:
            if isinstance(exc, CompileError) or not from_compiler(exc):
                raise
            raise CompileError(compile_failure(name, exc)) from exc
        mark_backward(out, name)
        return out

    block.forward = run


# The cache key

#: the files whose code the compiled graphs depend on beyond what inductor's cache keys see: the custom ops'
#: schemas and fake implementations (the output strides a compiled graph asserts)
_OPS_SOURCES = ("attn/ops.py", "parallel/comm.py")


@functools.cache
def ops_digest() -> str:
    """A digest of :data:`_OPS_SOURCES`. Inductor's caches key a graph on its ops' names, not on their fake
    implementations: without it, graphs compiled against older fakes would be loaded after an upgrade."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for rel in _OPS_SOURCES:
        digest.update((root / rel).read_bytes())
    return digest.hexdigest()[:16]


def tag_compile_cache() -> None:
    """Add ``loongtrain-ops-<ops_digest()>`` to torch.compile's cache key tag (``torch.compiler.config``, for the
    process: set once, not around each call, which would cost a config patch per block call), keeping a tag
    the user set."""
    user = torch.compiler.config.cache_key_tag
    ours = f"loongtrain-ops-{ops_digest()}"
    if ours not in user:
        torch.compiler.config.cache_key_tag = f"{user}+{ours}" if user else ours


def compile_blocks(model: nn.Module, layers: list[nn.Module], backend: str | None = None) -> list[str]:
    """The compile step: :func:`compile_block` on each decoder block of ``model`` (the compile cache tagged
    with the ops' digest: :func:`tag_compile_cache`); returns their names."""
    tag_compile_cache()
    names = {id(m): n for n, m in model.named_modules()}
    compiled = []
    for block in layers:
        name = names.get(id(block), type(block).__name__)
        compile_block(block, name, backend)
        compiled.append(name)
    log.info("compiled %d decoder blocks with torch.compile (backend %s)", len(compiled), backend or BACKEND)
    return compiled
