"""The gradient buckets: filled in order up to their size; bad plans refused."""

from __future__ import annotations

import pytest

from loongtrain.parallel.buckets import BUCKET_BYTES, gradient_buckets


def test_buckets_fill_in_order_up_to_the_size():
    assert gradient_buckets([4, 4, 4, 4, 4], 8) == [[0, 1], [2, 3], [4]]
    assert gradient_buckets([4, 20, 4, 4], 8) == [[0], [1], [2, 3]]  # a larger gradient travels alone
    assert gradient_buckets([3, 3, 3], 9) == [[0, 1, 2]]
    assert gradient_buckets([], 8) == []
    assert gradient_buckets([2, 2, 2, 2], 8, kinds=["f32", "f32", "bf16", "bf16"]) == [[0, 1], [2, 3]]
    assert BUCKET_BYTES == 32 * 1024 * 1024
    sizes = [3 << 20] * 40
    buckets = gradient_buckets(sizes)
    assert [i for b in buckets for i in b] == list(range(40))  # every gradient once, in order
    assert all(sum(sizes[i] for i in b) <= BUCKET_BYTES for b in buckets) and len(buckets) == 4


@pytest.mark.parametrize("args, match", [(([1], 0), "bucket_bytes=0"), (([1, -2], 8), "negative"),
                                         (([1, 2], 8, ["a"]), "1 kinds for 2")])
def test_bucket_plan_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        gradient_buckets(*args)
