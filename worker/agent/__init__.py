"""The worker agent: registers a node, claims work over HTTP, launches torchrun."""
