"""specserve: lossless speculative decoding for LLM inference."""

from specserve.config import SamplingParams
from specserve.engine.sequence import CompletionOutput, RequestOutput
from specserve.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
