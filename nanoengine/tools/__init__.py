"""The command line's other tools: prefix-report (where a prompt template breaks prefix-cache reuse) and
cpu-info (what the CPU kernels were built for); nanoengine/cli.py dispatches to them."""
