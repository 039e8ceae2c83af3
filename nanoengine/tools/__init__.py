"""The command line's other tools: cpu-info (what the CPU kernels were built for)."""
