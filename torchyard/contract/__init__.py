"""The contract between torchyard's processes: what the API service, the worker agent,
the trainer and the CLI/client agree on, importable by each of them.

No HTTP framework, database or torch here (an import-linter contract in pyproject.toml
keeps it so): error codes (``errors``), header names (``headers``), metric names
(``metrics``), placement statuses (``placement``), the job kinds and their specs
(``jobspec``: ``JobKind``), the worker protocol with one claimed placement per kind
(``protocol``), report batches (``reports``), failures (``failures``), the response bodies
the service and the client share (``responses``), the trainer's ``job.json`` (``jobfile``)
and ``events.jsonl`` (``run_events``), the dataset checksum
(``dataset_digest``), file hashing and locking (``files``), the safe archive extractor
both the service and the agents use (``archive``) and the model archive format
(``model_archive``).
"""
