"""A Llama-style example model (``model``, plain PyTorch) and its parallelization (``parallel``)."""

from examples.llama.model import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig"]
