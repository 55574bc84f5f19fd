"""verispec: an LLM inference engine whose speculative decoding is fast and whose acceptance can be trusted."""

from verispec.core.version import __version__
from verispec.outputs import CompletionOutput, RequestOutput
from verispec.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it lazily so `import verispec` stays cheap.
    if name == "LLM":
        from verispec.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
