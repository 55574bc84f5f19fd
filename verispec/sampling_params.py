"""Public home of the sampling options, under vLLM's module name: `from verispec.sampling_params
import SamplingParams`. The definitions live in the leaf package (verispec/core/sampling_params.py)
because every layer reads them."""

from verispec.core.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    any_params,
    with_output_kind,
)

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams", "any_params", "with_output_kind"]
