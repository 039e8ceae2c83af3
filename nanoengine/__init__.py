"""nanoengine: a small, readable LLM inference engine in the spirit of vLLM's V1 engine."""

from nanoengine.engine.arg_utils import EngineArgs
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.llm import LLM
from nanoengine.outputs import CompletionOutput, EngineStats, Logprob, RequestMetrics, RequestOutput
from nanoengine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "StructuredOutputsParams", "RequestOutputKind",
           "RequestOutput", "CompletionOutput", "RequestMetrics", "Logprob", "EngineStats"]
