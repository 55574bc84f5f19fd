"""`verispec bench`: latency, throughput, spec, serve, linear and profile, each against its peers on the same prompts in the same process."""
