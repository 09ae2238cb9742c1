"""aspire_ray: fast, exact long-context LLM decoding (ASPIRE self-speculation) on Ray."""

from .llm import LLM
from .outputs import RequestMetrics, RequestOutput
from .sampling_params import InvalidRequestError, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "RequestMetrics", "InvalidRequestError"]
__version__ = "0.1.0"
