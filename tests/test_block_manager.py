"""The block manager's contract, tested on its own (no model)."""

import pytest

from nanoengine.engine.block_manager import HASH_ALGOS, BlockManager, hash_block
from nanoengine.engine.request import Request
from nanoengine.sampling_params import SamplingParams

BS = 4  # block size: small, so a few tokens fill blocks


def make_request(tokens: list[int], salt: str | None = None, rid: str = "r", **params) -> Request:
    return Request(rid, None, list(tokens), SamplingParams(**params), arrival_time=0.0, cache_salt=salt)


@pytest.fixture
def colliding(monkeypatch) -> BlockManager:
    """A block manager whose hash is the length of what it hashes: every block 0 of a given size collides
    with every other, and so does every later block."""
    monkeypatch.setitem(HASH_ALGOS, "length", (len, 8))
    return BlockManager(4, BS, hash_algo="length")


def admit(bm: BlockManager, request: Request) -> int:
    """Schedule the whole request as the scheduler would; return how many tokens came from the cache."""
    prefix = bm.find_cached_prefix(request)
    cached = len(prefix) * BS
    assert bm.allocate_slots(request, request.num_tokens - cached, prefix)
    request.num_computed_tokens = request.num_tokens
    return cached


def holders(bm: BlockManager, requests: list[Request]) -> dict[int, int]:
    counts = {}
    for r in requests:
        for b in r.block_ids:
            counts[b] = counts.get(b, 0) + 1
    return counts


def check_ref_counts(bm: BlockManager, live: list[Request]) -> None:
    counts = holders(bm, live)
    for block in bm.blocks:
        assert block.ref_count == counts.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in bm.free_blocks)


def test_hash_chains_over_parent_and_tokens():
    first = hash_block(None, [1, 2, 3, 4], None)
    assert hash_block(first, [5, 6, 7, 8], None) != hash_block(None, [5, 6, 7, 8], None)
    assert hash_block(first, [5, 6, 7, 8], None) == hash_block(first, [5, 6, 7, 8], None)
    assert hash_block(first, [5, 6, 7, 9], None) != hash_block(first, [5, 6, 7, 8], None)
    bm = BlockManager(8, BS)
    request = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.update_block_hashes(request)
    assert request.block_hashes == [first, hash_block(first, [5, 6, 7, 8], None)]  # only full blocks


def test_shared_prefix_is_reused_but_last_token_is_always_computed():
    bm = BlockManager(16, BS)
    a = make_request(list(range(10)), rid="a")
    assert admit(bm, a) == 0
    b = make_request(list(range(10)) + [99], rid="b")
    assert admit(bm, b) == 8  # two full blocks; the partial third is not shared
    assert b.block_ids[:2] == a.block_ids[:2]
    c = make_request(list(range(8)), rid="c")  # exactly two blocks: the last one must be recomputed
    assert admit(bm, c) == 4
    check_ref_counts(bm, [a, b, c])
    assert bm.blocks[a.block_ids[0]].ref_count == 3


def test_salt_isolates_tenants():
    bm = BlockManager(16, BS)
    tokens = list(range(12))
    a, b, c = make_request(tokens, "alice", "a"), make_request(tokens, "bob", "b"), make_request(tokens, "alice", "c")
    admit(bm, a)
    assert admit(bm, b) == 0
    assert not set(a.block_ids) & set(b.block_ids)
    assert admit(bm, c) == 8
    assert hash_block(None, [1, 2, 3, 4], "alice") != hash_block(None, [1, 2, 3, 4], "bob")


def test_hash_hit_with_different_tokens_is_rejected():
    bm = BlockManager(16, BS)
    a = make_request(list(range(9)), rid="a")
    admit(bm, a)
    impostor = make_request([50, 51, 52, 53, 54], rid="x")
    bm.update_block_hashes(impostor)
    impostor.block_hashes[0] = a.block_hashes[0]  # a forged collision
    assert bm.find_cached_prefix(impostor) == []


def test_colliding_hashes_never_share_a_block_across_salts(colliding):
    alice, carol = make_request(list(range(5)), "alice", "a"), make_request(list(range(5)), "carol", "c")
    admit(colliding, alice)
    assert colliding.find_cached_prefix(carol) == []
    assert carol.block_hashes == alice.block_hashes  # the same hash and tokens, but another salt


def test_a_child_whose_parent_slot_was_reused_is_not_a_hit(colliding):
    bm = colliding
    owner = make_request([1, 2, 3, 4], rid="owner")
    admit(bm, owner)  # block 0 holds [1, 2, 3, 4]
    parent = bm.blocks[owner.block_ids[0]]
    # A request that reads no cache computes its own copy of [1, 2, 3, 4], and names its next block as the
    # child of the cached block that holds that prefix.
    reader = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9], rid="reader", prompt_logprobs=0)
    admit(bm, reader)
    child = bm.blocks[reader.block_ids[1]]
    assert child.parent == parent.serial and bm.blocks[reader.block_ids[0]].block_hash is None
    bm.free(owner)
    other = make_request([11, 12, 13, 14], rid="other")  # a colliding prefix in the parent's old slot
    admit(bm, other)
    assert other.block_ids == [parent.block_id]
    follower = make_request([11, 12, 13, 14, 5, 6, 7, 8, 9], rid="follower")
    assert bm.find_cached_prefix(follower) == [parent]  # the child's tokens and hash match; its parent does not
    equal = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], rid="equal")
    assert bm.find_cached_prefix(equal) == []  # [1, 2, 3, 4] is no longer cached: nothing after it is found


def test_freed_blocks_keep_their_prefix_until_reused_in_lru_order():
    bm = BlockManager(6, BS)
    a = make_request(list(range(8)) + [100], rid="a")  # 2 full blocks + 1 partial
    admit(bm, a)
    a_blocks = list(a.block_ids)
    bm.free(a)
    assert bm.num_free_blocks == 6
    assert bm.num_cached_free_blocks == 2
    # The unhashed partial block is handed out first, then the never-used blocks, then a's tail, then its head.
    order = list(bm.free_blocks)
    assert order[0] == a_blocks[2]
    assert order.index(a_blocks[1]) < order.index(a_blocks[0])
    again = make_request(list(range(8)) + [200], rid="again")
    assert admit(bm, again) == 8  # taken back out of the free queue
    assert again.block_ids[:2] == a_blocks[:2]
    check_ref_counts(bm, [again])


def test_eviction_drops_the_hash_of_the_reused_block():
    bm = BlockManager(3, BS)
    a = make_request(list(range(8)) + [1], rid="a")
    admit(bm, a)
    bm.free(a)
    b = make_request([70 + i for i in range(9)], rid="b")  # needs every block: a's prefix is evicted
    assert admit(bm, b) == 0
    assert bm.cached_blocks.keys() == set(b.block_hashes)
    bm.free(b)
    assert admit(bm, make_request(list(range(8)) + [1], rid="a2")) == 0


def test_allocation_failure_changes_nothing():
    bm = BlockManager(2, BS)
    a = make_request(list(range(12)), rid="a")
    free_before = list(bm.free_blocks)
    assert not bm.allocate_slots(a, 12)
    assert a.block_ids == [] and list(bm.free_blocks) == free_before


def test_no_leak_when_everything_finished():
    bm = BlockManager(32, BS)
    live = []
    for i in range(6):
        r = make_request(list(range(i * 3)) + [i] * 7, salt=str(i % 2), rid=str(i))
        admit(bm, r)
        live.append(r)
        check_ref_counts(bm, live)
    for r in live[::2] + live[1::2]:
        bm.free(r)
    assert bm.num_free_blocks == 32
    assert all(b.ref_count == 0 for b in bm.blocks)


@pytest.mark.parametrize("enable", [True, False])
def test_prefix_cache_statistics_count_tokens(enable):
    bm = BlockManager(16, BS, enable_prefix_caching=enable)
    for rid in "ab":
        r = make_request(list(range(9)), rid=rid)
        prefix = bm.find_cached_prefix(r)
        assert bm.allocate_slots(r, 9 - len(prefix) * BS, prefix)
        bm.record_lookup(r, prefix)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == ((18, 8) if enable else (0, 0))


def test_reset_prefix_cache_forgets_every_hash():
    bm = BlockManager(16, BS)
    a = make_request(list(range(9)), rid="a")
    admit(bm, a)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.num_cached_free_blocks == 0
    assert admit(bm, make_request(list(range(9)), rid="b")) == 0


def test_sha256_chains_like_the_default_hash():
    bm = BlockManager(16, BS, hash_algo="sha256")
    a, b = make_request(list(range(10)), rid="a"), make_request(list(range(10)) + [99], rid="b")
    admit(bm, a)
    assert admit(bm, b) == 8
    first = hash_block(None, [1, 2, 3, 4], None, "sha256")
    assert first.bit_length() > 64 and first != hash_block(None, [1, 2, 3, 4], None)
    assert hash_block(first, [5, 6, 7, 8], None, "sha256") != hash_block(None, [5, 6, 7, 8], None, "sha256")
