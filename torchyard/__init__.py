"""torchyard: a self-hosted service for training PyTorch image classifiers on a cluster."""

__version__ = "0.1.0"
