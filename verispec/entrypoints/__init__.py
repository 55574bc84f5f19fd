"""What users call: the LLM class, the `verispec` command and the OpenAI-compatible HTTP server, thin layers over one engine."""
