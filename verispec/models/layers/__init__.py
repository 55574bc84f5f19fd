"""The layers a decoder shares: RMSNorm and rotary embeddings (torch; Triton kernels only where a model is switched onto them)."""
