"""``python bench.py --preset profile``: where one step's time goes, for a given load.

``--num-prompts`` requests (default 32) of ``--prompt-len`` random tokens (default 128) each generate 32 tokens
on the cpu preset's model and dtype (the gpu preset's on a GPU). Every step is timed by part: the scheduler;
the model's linear layers, attention, small ops (norms, SiLU-and-mul, rotary lookup, embedding) and the Python
between them (the model's forward less its timed modules); sampling; the output side (detokenizing, stops,
outputs, drafting); and the engine's own rest. Steps that compute a prompt and steps that only decode are shown
apart, as milliseconds per step and shares. Module hooks time the parts, so the model runs its Python forward
(no CUDA graphs, not the CPU's layers in one call, which runs the same kernels without the Python between):
the parts add up to a little more than an unprofiled step.
"""

import time
from collections import defaultdict
from contextlib import contextmanager

from benchmarks.common import model_for, on_gpu, preset_workload, sync
from nanoengine import LLM, SamplingParams
from nanoengine.layers.activation import SiluAndMul
from nanoengine.layers.attention import Attention
from nanoengine.layers.embedding import VocabParallelEmbedding
from nanoengine.layers.linear import LinearBase
from nanoengine.layers.norm import RMSNorm
from nanoengine.layers.rotary import RotaryEmbedding

PARTS = ("scheduler", "linear layers", "attention", "small ops", "Python between ops", "sampling", "output side",
         "engine (rest)")
CATEGORIES = ((LinearBase, "linear layers"), (Attention, "attention"),
              ((RMSNorm, SiluAndMul, RotaryEmbedding, VocabParallelEmbedding), "small ops"))


class StepClock:
    """Seconds per part of the step now running; the hooks add to it."""

    def __init__(self):
        self.parts: dict[str, float] = defaultdict(float)

    @contextmanager
    def timing(self, part: str):
        sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            sync()
            self.parts[part] += time.perf_counter() - start

    def wrap(self, owner, name: str, part: str) -> None:
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            with self.timing(part):
                return method(*args, **kwargs)

        setattr(owner, name, timed)

    def hook_modules(self, model) -> None:
        for module in model.modules():
            # The LM head is a VocabParallelEmbedding too: it counts as a linear layer.
            part = "linear layers" if type(module).__name__ == "ParallelLMHead" else next(
                (part for types, part in CATEGORIES if isinstance(module, types)), None)
            if part is not None:
                module.register_forward_pre_hook(self.start_module)
                module.register_forward_hook(lambda *_, part=part: self.end_module(part))

    def start_module(self, *_) -> None:
        sync()
        self.module_start = time.perf_counter()

    def end_module(self, part: str) -> None:  # timed modules do not nest
        sync()
        self.parts[part] += time.perf_counter() - self.module_start


def profile_preset(args) -> dict:
    workload = preset_workload("gpu" if on_gpu() else "cpu", args.dtype)
    num_prompts, prompt_len = args.num_prompts or 32, args.prompt_len
    with LLM(model_for(args), dtype=workload.dtype, max_model_len=prompt_len + 64, enforce_eager=True,
             quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype) as llm:
        engine, clock = llm.llm_engine, StepClock()
        runner = engine.model_executor.runner
        runner.fast_path = None  # the modules' forwards, which the hooks can time
        llm.generate([[1] * 16], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        clock.hook_modules(runner.model)
        clock.wrap(engine.scheduler, "schedule", "scheduler")
        clock.wrap(runner, "forward", "model")
        clock.wrap(runner, "sample_step", "sampling")
        for owner, name in ((engine.output_processor, "process"), (engine.drafter, "propose")):
            clock.wrap(owner, name, "output side")
        totals = {"prompt": defaultdict(float), "decode": defaultdict(float)}
        counts = {"prompt": 0, "decode": 0}
        prompts = [[(7 * i + 13 * j) % 1000 + 100 for j in range(prompt_len)] for i in range(num_prompts)]
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"profile-{i}", prompt, params)
        while engine.has_unfinished_requests():
            clock.parts.clear()
            decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.requests.values())
            with clock.timing("step"):
                engine.step()
            kind = "decode" if decoding else "prompt"
            counts[kind] += 1
            for part, seconds in clock.parts.items():
                totals[kind][part] += seconds
    return {"preset": "profile", "model": llm.config.model, "dtype": workload.dtype, "num_prompts": num_prompts,
            "prompt_len": prompt_len, "steps": counts,
            "ms_per_step": {kind: split(totals[kind], counts[kind]) for kind in totals if counts[kind]}}


def split(total: dict[str, float], num_steps: int) -> dict[str, float]:
    """Milliseconds per step for each part: the model's forward less its timed modules is the Python between them,
    and the step less every part the engine's own rest."""
    ms = {part: 1000 * seconds / num_steps for part, seconds in total.items()}
    modules = sum(ms.get(part, 0.0) for _, part in CATEGORIES)
    ms["Python between ops"] = max(0.0, ms.pop("model", 0.0) - modules)
    ms["sampling"] = ms.get("sampling", 0.0)
    step = ms.pop("step")
    ms["engine (rest)"] = max(0.0, step - sum(ms.values()))
    return {"step": step} | {part: ms.get(part, 0.0) for part in PARTS}


def print_profile(report: dict) -> None:
    print(f"step profile: {report['num_prompts']} requests of {report['prompt_len']} prompt tokens, 32 output "
          f"tokens each, {report['dtype']}, {report['model']}")
    for kind, ms in report["ms_per_step"].items():
        print(f"\n{kind} steps ({report['steps'][kind]}): {ms['step']:.2f} ms a step")
        for part in PARTS:
            print(f"  {part:<20} {ms[part]:8.2f} ms  {100 * ms[part] / ms['step']:5.1f}%")
