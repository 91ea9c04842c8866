"""The embedded SmolLM2 model: GGUF on PyPI -> a plain HF folder every engine and trainer can load."""

from skyrl_stepwise.models.prepare import MODEL_NAME, gguf_path, prepare_model, resolve_model_path

__all__ = ["MODEL_NAME", "gguf_path", "prepare_model", "resolve_model_path"]
