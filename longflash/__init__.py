"""longflash: long-context MLA inference with DFlash speculative decoding."""

from longflash.outputs import CompletionOutput, RequestOutput
from longflash.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"


def __getattr__(name):
    # LLM pulls in the engine and torch models; import it lazily so `import longflash` stays light.
    if name == "LLM":
        from longflash.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "__version__"]
