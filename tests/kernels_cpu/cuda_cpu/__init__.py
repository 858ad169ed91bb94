"""CUDA-on-CPU test harness: compile the unmodified kernels/*.cu with g++ and run them on the CPU."""
