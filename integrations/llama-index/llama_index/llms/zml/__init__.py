"""LlamaIndex LLM integration of zml: ``from llama_index.llms.zml import ZML``."""

from llama_index.llms.zml.base import ZML

__all__ = ["ZML"]
