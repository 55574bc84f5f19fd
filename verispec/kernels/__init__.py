"""The Triton kernels (CUDA; Triton's interpreter in the CPU tests). This package imports nothing; each
kernel module imports triton, so the layers above import one only on the CUDA path
(models/kernel_path.py, attention/triton.py, worker/graphs.py and worker/sampler.py at first use).
cpu_gguf.py is the exception: the CPU GEMV over GGUF blocks, a C library (cpu_gguf.c) it builds and loads
through ctypes; it imports no triton."""
