"""What a test's own compiled blocks compiled, counted by the test: a ``torch.compile`` backend that records
each graph it is handed and compiles it with the real backend. A test reads its own count, never dynamo's
global ``counters``, which any other test (or ``torch._dynamo.reset``) may clear or fill."""

from __future__ import annotations

from typing import Any

import torch
import torch._dynamo


class GraphCounter:
    """``backend`` (a name: ``aot_eager``, ``inductor``; or a backend callable) with a count: :attr:`graphs`
    holds every FX graph dynamo compiled through it (one per unique graph: a recompile or a graph break adds
    one)."""

    def __init__(self, backend: Any = "inductor") -> None:
        self.backend = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.graphs.append(gm)
        return self.backend(gm, example_inputs)

    @property
    def count(self) -> int:
        return len(self.graphs)


def no_graph_breaks() -> Any:
    """Inside (while dynamo traces): a graph break is an error naming its cause, not a second graph."""
    return torch._dynamo.error_on_graph_break(True)
