"""`loongtrain.attention` given cu_seqlens of the wrong kind: a ValueError naming the element and its type."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("cu, needle", [
    ([0.0, 4.0, 8.0], r"cu_seqlens\[0\]\[0\] = 0.0 \(float\)"),
    ([0, 4.5, 8], r"cu_seqlens\[0\]\[1\] = 4.5"),
    ([0, True, 8], r"cu_seqlens\[0\]\[1\] = True"),
    (torch.tensor([0, 4, 8], device="meta"), "meta device"),
    (torch.tensor([0.0, 4.0, 8.0]), "1-D integer tensor"),
    ("0,4,8", "got str"),
    ([[0, 4, 8], [0, 8.0]], r"cu_seqlens\[1\]\[1\] = 8.0"),
])
def test_cu_seqlens_of_the_wrong_kind_raise_value_error(cu, needle):
    from loongtrain import attention

    q = torch.randn(1 if not isinstance(cu, list) or not isinstance(cu[0], list) else 2, 8, 2, 4)
    with pytest.raises(ValueError, match=needle):
        attention(q, q, q, None, cu_seqlens=cu)
