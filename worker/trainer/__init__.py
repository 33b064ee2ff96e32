"""The training program that ``torchrun`` starts on every rank.

Launched by the worker agent as::

    python -m torch.distributed.run --nnodes N --nproc-per-node P ... \\
        -m worker.trainer --config RUN_DIR/job.json

(without torchrun it runs as a one-process job, which is handy for debugging).

Outputs, under the job's ``output_dir``:

- ``events.jsonl`` (rank 0): one JSON object per line, flushed per line: ``metric``
  (``train.loss``, ``train.lr``, ``train.images_per_sec`` every ``print_frequency``
  global steps and at each epoch end; ``val.loss``, ``val.top1``, ``val.top5`` with >= 5
  classes, and ``epoch.seconds`` once per epoch), ``progress``, and a final ``result``
  written just before ``model/`` appears. Epochs are 1-based; ``step`` counts optimizer
  steps of the whole job. A resumed attempt appends to the file.
- ``checkpoint.pt`` (rank 0, after every epoch, atomic): see :mod:`.checkpoint`. If it
  exists at start and belongs to the same job, training resumes after its epoch.
- ``model/`` (rank 0, on success, atomic): the model directory of
  :mod:`torchyard.modeldir`, holding the weights of the epoch with the lowest
  validation loss.
- ``failure-rank-<RANK>.json`` (any rank, on failure, atomic): see :mod:`.failure`.
  The process then exits with status 1.

Environment (besides torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``...):

- ``TORCHYARD_NODE_NAME``: the node's name, copied into failure files (default: hostname);
- ``OMP_NUM_THREADS``: CPU threads per rank (``torch.set_num_threads``);
- ``TORCHYARD_PG_TIMEOUT_S``: bound on every collective, default 120 s, so a rank whose
  peer died fails instead of waiting forever;
- ``TORCHYARD_DEVICE``: ``cpu`` forces CPU training on a CUDA machine (default: CUDA when
  available, one GPU per local rank);
- ``TORCHYARD_TRAINER_HOOKS``: modules of the node's own told where a rank is in its
  training (before each step, at known points); see :mod:`.hooks`.
"""
