"""attnserve: a compact LLM inference engine built around a pluggable attention-backend layer."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):  # lazy: importing attnserve must not load torch-heavy modules
    if name == "LLM":
        from attnserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from attnserve.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
