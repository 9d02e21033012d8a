"""The one shard-grouping rule (``store.shard_layout``), used by ``bridge.save`` and the streamed writer alike."""

from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.checkpoint.store import SINGLE, shard_layout


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 100), max_size=30), st.integers(1, 150))
def test_groups_fill_shards_in_order_until_the_next_would_pass_the_limit(sizes, limit):
    layout = shard_layout(sizes, limit)
    shards = list(layout.values())
    assert [i for s in shards for i in s] == list(range(len(sizes)))  # every group once, in order, never split
    for s in shards:
        assert s or not sizes  # an empty shard only for an empty checkpoint
        assert len(s) <= 1 or sum(sizes[i] for i in s) <= limit  # over the limit only a group alone
    for s, nxt in zip(shards, shards[1:]):  # greedy: the next shard's first group would not have fitted
        assert sum(sizes[i] for i in s) + sizes[nxt[0]] > limit
    n = len(shards)
    assert list(layout) == ([SINGLE] if n == 1 else [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)])


def test_sizes_read_as_the_command_reads_them():
    assert list(shard_layout([600, 600, 600], "1KB").values()) == [[0], [1], [2]]
    assert list(shard_layout([400, 500, 600], "1KB").values()) == [[0, 1], [2]]
