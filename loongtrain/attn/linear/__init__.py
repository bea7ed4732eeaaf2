"""Linear attention (the gated delta rule of Qwen3.5 / Qwen3-Next, KDA of Kimi-Linear) through the 2D mesh
(docs/linear-attention.md): ``api.py`` (``loongtrain.linear_attention``), ``layout.py`` (the runs, halos and
composition order, mesh-free), ``ops.py`` (the exchange over the context ranks as custom ops), ``kernels.py`` (the
local kernels and their choice). The local math is :mod:`loongtrain.model.delta_rule`."""
