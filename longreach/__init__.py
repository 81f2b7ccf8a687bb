"""longreach: million-token inference for pretrained Llama-family models on one GPU, with no retraining.

`import longreach` is cheap: it does not import torch or touch CUDA; `LLM` loads the engine on first use.
"""
from .sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from .engine.llm import LLM

        return LLM
    if name == "EngineConfig":
        from .config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'longreach' has no attribute {name!r}")
