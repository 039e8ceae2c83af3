"""The paged KV cache's bookkeeping: blocks, reference counts and the prefix cache.

Every request holds a list of block ids (its block table). A *full* block is
looked up by a chained hash: hash(parent block's hash, its token ids, and for
block 0 the request's cache salt). When a request finishes its blocks go back
to a free queue in LRU order but keep their name, so a later request with the
same prefix can take them back (a prefix-cache hit) until they are handed out
again and evicted.

A hit is exact whatever the hash does: a named block also stores its own token
ids and what it continues (the salt for block 0, else its parent's serial, a
number no other naming of any block ever gets). A lookup walks from block 0 and
takes block i only if its tokens match and its parent is the block it just took
for i - 1, so by induction the salt and every token up to block i are the
request's. A parent slot that was handed out again has a new serial, so the
children it had before match nothing.
"""

import hashlib
from array import array
from collections import OrderedDict
from itertools import count

import xxhash

from nanoengine.engine.request import Request


def sha256(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest(), "little")


# prefix_caching_hash_algo's choices: a function of bytes to an int, and that int's width in bytes.
HASH_ALGOS = {"xxhash": (xxhash.xxh3_64_intdigest, 8), "sha256": (sha256, 32)}


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "parent", "serial")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None  # set while the block is named in the prefix cache
        self.token_ids: tuple[int, ...] | None = None  # the block's own tokens, compared on every hit
        self.parent: str | int | None = None  # what it continues: block 0's salt, else its parent's serial
        self.serial = -1  # this naming's number: no other naming of any block ever gets it


def hash_block(parent_hash: int | None, token_ids: list[int], cache_salt: str | None, algo: str = "xxhash") -> int:
    digest, width = HASH_ALGOS[algo]
    # Block 0 carries the salt, and so every block after it does too.
    head = b"salt:" + (cache_salt or "").encode() if parent_hash is None else parent_hash.to_bytes(width, "little")
    return digest(head + array("q", token_ids).tobytes())


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_algo: str = "xxhash"):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_algo = hash_algo
        self.serials = count()
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first; an OrderedDict removes any of them in O(1) on a cache hit.
        self.free_blocks: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_blocks: dict[int, Block] = {}  # block hash -> the block holding that prefix
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self.free_blocks.values() if b.block_hash is not None)

    def update_block_hashes(self, request: Request) -> None:
        """Extend the request's hash chain over every block its known tokens fill."""
        tokens, size = request.all_token_ids, self.block_size
        while (len(request.block_hashes) + 1) * size <= len(tokens):
            i = len(request.block_hashes)
            parent = request.block_hashes[-1] if i else None
            request.block_hashes.append(hash_block(parent, tokens[i * size:(i + 1) * size], request.cache_salt,
                                                   self.hash_algo))

    def reads_cache(self, request: Request) -> bool:
        """A request that asks for prompt logprobs computes its whole prompt, as in vLLM (it still fills the cache)."""
        return self.enable_prefix_caching and request.params.prompt_logprobs is None

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """The longest run of cached blocks that matches the start of the request, exactly.

        At least the last prompt token is computed, so there are logits to sample from: a prompt that
        ends on a block boundary recomputes its whole last block.
        """
        if not self.reads_cache(request):
            return []
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits, parent = [], request.cache_salt or ""
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = self.cached_block(block_hash, parent, self.block_tokens(request, i))
            if block is None:
                break
            hits.append(block)
            parent = block.serial
        return hits

    def cached_block(self, block_hash: int, parent: str | int | None, token_ids: tuple[int, ...]) -> Block | None:
        """The block named for exactly this prefix (its hash, its parent and its own tokens), if any."""
        block = self.cached_blocks.get(block_hash)
        if block is None or block.parent != parent or block.token_ids != token_ids:
            return None
        return block

    def block_tokens(self, request: Request, i: int) -> tuple[int, ...]:
        return tuple(request.all_token_ids[i * self.block_size:(i + 1) * self.block_size])

    def record_lookup(self, request: Request, cached_prefix: list[Block]) -> None:
        """Count a scheduled request's prefix-cache lookup, in tokens as vLLM does."""
        if self.reads_cache(request):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(cached_prefix) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_prefix: list[Block] = ()) -> bool:
        """Give the request blocks for ``cached_prefix`` plus ``num_new_tokens`` more tokens.

        Returns False, changing nothing, when there are not enough free blocks.
        """
        num_tokens = request.num_computed_tokens + len(cached_prefix) * self.block_size + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - len(request.block_ids) - len(cached_prefix)
        num_reclaimed = sum(1 for b in cached_prefix if b.ref_count == 0)  # hits that sit in the free queue
        if num_needed > self.num_free_blocks - num_reclaimed:
            return False
        for block in cached_prefix:
            if block.ref_count == 0:
                del self.free_blocks[block.block_id]
            block.ref_count += 1
            request.block_ids.append(block.block_id)
        for _ in range(max(num_needed, 0)):
            request.block_ids.append(self.take_free_block().block_id)
        self.register_full_blocks(request, num_tokens)
        return True

    def take_free_block(self) -> Block:
        _, block = self.free_blocks.popitem(last=False)
        self.evict(block)
        block.ref_count = 1
        return block

    def evict(self, block: Block) -> None:
        """Drop the block's prefix from the cache."""
        if block.block_hash is not None and self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
        block.block_hash = block.token_ids = block.parent = None

    def register_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Name the blocks that the first ``num_tokens`` tokens fill, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        self.update_block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        parent = request.registered_parent if request.num_registered_blocks else request.cache_salt or ""
        for i in range(request.num_registered_blocks, num_full):
            block, block_hash, tokens = self.blocks[request.block_ids[i]], request.block_hashes[i], \
                self.block_tokens(request, i)
            # This block itself after a hit, or an equal block that another request named first.
            holder = self.cached_block(block_hash, parent, tokens)
            if holder is None and parent is not None and block.block_hash is None \
                    and block_hash not in self.cached_blocks:
                block.block_hash, block.token_ids, block.parent = block_hash, tokens, parent
                block.serial = next(self.serials)
                self.cached_blocks[block_hash] = holder = block
            # None once another prefix holds a hash of the chain: no lookup could reach what follows.
            parent = request.registered_parent = None if holder is None else holder.serial
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)

    def free(self, request: Request, num_kept_blocks: int = 0) -> None:
        """Release the request's blocks (past the first ``num_kept_blocks``); the tail goes first so that
        shared prefixes outlive suffixes.

        Blocks are named when they are allocated, before the step computes them. A request preempted in the
        same step it was scheduled never computes them, so they lose their name: their KV was never written.
        """
        num_computed_blocks = request.num_computed_tokens // self.block_size
        for i in reversed(range(num_kept_blocks, len(request.block_ids))):
            block = self.blocks[request.block_ids[i]]
            if i >= num_computed_blocks:
                self.evict(block)
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block.block_id] = block
                if block.block_hash is None:  # nothing worth keeping: hand it out first
                    self.free_blocks.move_to_end(block.block_id, last=False)
        del request.block_ids[num_kept_blocks:]
        request.num_registered_blocks = min(request.num_registered_blocks, num_kept_blocks)

    def reset_prefix_cache(self) -> None:
        for block in list(self.cached_blocks.values()):
            self.evict(block)
