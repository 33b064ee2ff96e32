"""Helpers shared by the tests: factories, real agents and API processes, datasets, sandboxes."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
