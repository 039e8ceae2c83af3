"""Which engine core gets a request: the one holding its longest cached prefix, within a margin of the
least loaded one (docs/design.md says why a margin).

The front remembers, per core, the chained block hashes of the prompts it sent there lately (the block
manager's own, salt included), in an LRU as long as the core's KV cache. A core's load is vLLM's score,
waiting * 4 + running, where a request sent but not yet reported running counts as waiting.
"""

from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import count

from nanoengine.engine.block_manager import hash_block

LOAD_MARGIN = 8  # prefix routing gives way when its core's load exceeds the least loaded one's by more (2 waiting)


@dataclass
class CoreLoad:
    """What the front knows of one core, for routing."""

    rank: int
    capacity: int = 0  # blocks remembered: the core's KV-cache size
    num_running: int = 0  # as the core last reported
    request_ids: set[str] = field(default_factory=set)  # sent to it and not finished
    recent_hashes: OrderedDict[int, None] = field(default_factory=OrderedDict)  # least recently sent first

    def load(self) -> int:
        num_waiting = max(len(self.request_ids) - self.num_running, 0)
        return 4 * num_waiting + min(self.num_running, len(self.request_ids))

    def num_cached_blocks(self, hashes: list[int]) -> int:
        """How many leading blocks of this chain the core computed lately."""
        return next((i for i, h in enumerate(hashes) if h not in self.recent_hashes), len(hashes))

    def remember(self, hashes: list[int]) -> None:
        for block_hash in hashes:
            self.recent_hashes[block_hash] = None
            self.recent_hashes.move_to_end(block_hash)
        while len(self.recent_hashes) > self.capacity:
            self.recent_hashes.popitem(last=False)


def prompt_hashes(token_ids: list[int], cache_salt: str | None, block_size: int, algo: str) -> list[int]:
    """The chained hashes of the prompt's full blocks, as the block manager computes them."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[start:start + block_size], cache_salt,
                                 algo))
    return hashes


class Router:
    def __init__(self, policy: str):
        self.policy = policy
        self.turns = count()

    def pick(self, cores: list[CoreLoad], hashes: list[int]) -> CoreLoad:
        """The core for a request whose prompt blocks hash to ``hashes``, among the live ``cores``."""
        if self.policy == "round-robin":
            return cores[next(self.turns) % len(cores)]
        # Between equal loads, the core remembering the fewest blocks: a new prefix goes where there is room.
        least_loaded = min(cores, key=lambda core: (core.load(), len(core.recent_hashes), core.rank))
        if self.policy == "least-loaded":
            return least_loaded
        best = max(cores, key=lambda core: (core.num_cached_blocks(hashes), -core.load(), -core.rank))
        if best.num_cached_blocks(hashes) == 0 or best.load() > least_loaded.load() + LOAD_MARGIN:
            return least_loaded
        return best
