"""Model architectures (Qwen2 / Llama / Qwen3) as torch modules over a paged KV cache, and their layers; attention goes through an attention backend object."""
