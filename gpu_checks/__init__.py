"""The stages of gpu_check.py (the one-shot device check), one module per group of stages."""
