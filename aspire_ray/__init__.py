"""aspire_ray: fast, exact long-context LLM decoding (ASPIRE self-speculation) on Ray.

A light package face: importing it (or ``aspire_ray.config``, ``aspire_ray.kernels``, a serve
config's validation) does not import the engine; ``LLM`` loads it on first use.
"""

from .outputs import RequestMetrics, RequestOutput
from .sampling_params import InvalidRequestError, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "RequestMetrics", "InvalidRequestError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from .llm import LLM

        return LLM
    raise AttributeError(f"module 'aspire_ray' has no attribute {name!r}")
