"""labkit: helpers for the Multi-GPU Mistakes Lab notebooks."""
__version__ = "0.1.0"
