"""study: a harness for ablation and benchmarking studies of transformer design choices."""

__version__ = "0.1.0"
