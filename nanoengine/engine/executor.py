"""The executor: what LLMEngine runs each step on (vLLM's layer of that name).

Rank 0's ModelRunner lives in the engine's process and samples. With tensor parallelism, a ``WorkerGroup``
(tp_group.py) also holds ranks 1..N-1, each with its own runner in a worker process, and gets each step
before rank 0 runs its share.
"""

import torch
import torch.distributed as dist

from nanoengine.config import EngineConfig
from nanoengine.engine.model_runner import ModelRunner, StepInputs, StepResult
from nanoengine.engine.scheduler import SchedulerOutput
from nanoengine.engine.structured_output import GrammarBitmask


class Executor:
    def __init__(self, config: EngineConfig):
        if dist.is_initialized():  # the layers would shard themselves over that group
            raise RuntimeError("torch.distributed is already initialized in this process (is a tensor-parallel "
                               "LLM still open?); close it before creating another LLM")
        if config.node_ranks()[0] != 0:
            raise ValueError(f"node_rank={config.node_rank} runs only the workers of its node: start it with "
                             "`nanoengine serve MODEL ... --headless`; the engine runs on node 0")
        self.workers = None
        if config.tensor_parallel_size == 1:
            self.runner = ModelRunner(config)
        else:
            from nanoengine.engine.tp_group import WorkerGroup

            self.workers = WorkerGroup(config, lambda: ModelRunner(config))
            self.runner = self.workers.runner

    @property
    def can_rerun_steps(self) -> bool:
        """A failed step leaves nothing behind on one rank: LLMEngine may rerun its requests one by one. A group's
        workers ran (or wait in) the failed step: they are told to exit."""
        return self.workers is None

    @torch.inference_mode()
    def execute_model(self, step: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None) -> StepResult:
        """Run the model on one step and sample; ``grammar_bitmask`` constrains the structured requests' rows."""
        inputs = StepInputs.of(step)
        logits = self.runner.forward(inputs) if self.workers is None else self.workers.forward(inputs)
        return self.runner.sample_step(step, inputs, logits, grammar_bitmask)

    def finish_request(self, request_id: str) -> None:
        """The request is done or aborted (workers drop their copy of its block table)."""
        if self.workers is not None:
            self.workers.finish_request(request_id)

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
        self.runner.close()
