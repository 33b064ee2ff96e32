"""The contract between torchyard's processes: what the API service, the worker agent,
the trainer and the CLI/client agree on, importable by each of them.

No HTTP framework, database or torch here (an import-linter contract in pyproject.toml
keeps it so): error codes (``errors``), header names (``headers``), metric names
(``metrics``), placement statuses (``placement``), the dataset checksum
(``dataset_digest``), the safe archive extractor both the service and the agents use
(``archive``) and the model archive format (``model_archive``).
"""
