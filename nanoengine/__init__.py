"""nanoengine: a small, readable LLM inference engine in the spirit of vLLM's V1 engine."""

from nanoengine.llm import LLM
from nanoengine.outputs import CompletionOutput, EngineStats, Logprob, RequestMetrics, RequestOutput
from nanoengine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "RequestMetrics", "Logprob", "EngineStats"]
