"""lineattn: linear-attention update rules, kernels, layers and models in JAX."""

__version__ = "0.1.0"
