"""An MLflow tracking endpoint for one script placement (docs/script-jobs.md).

Each placement of a script job on a node gets its own endpoint: a small HTTP server on the
loopback interface, on a port of its own, speaking the subset of MLflow's REST tracking
API (``/api/2.0/mlflow/...``) that the MLflow client, Lightning's ``MLFlowLogger`` and
Hugging Face's MLflow callback use. Every process of the placement gets
``MLFLOW_TRACKING_URI`` (the endpoint) and ``MLFLOW_TRACKING_TOKEN`` (a random token of
its own, which tells the endpoint the process's rank); a request without a token of this
placement is 401, so a script reaches its own job's runs and nothing else.

In the ``per_node`` launch mode the node's one command starts its ranks itself (``torchrun``
…), and they all inherit the node's token. Their points carry the rank of the process that
calls: the endpoint finds the process holding the other end of the connection (its socket
in ``/proc/net/tcp``, then the process with that socket open) and reads ``RANK`` from its
environment (the variable ``torchrun`` gives each rank), once per connection; where that
cannot be read, the node's first rank.

What it is told goes where the rest of a script's reports go, through files the
placement's reporter already ships exactly once:

* a metric point is one JSON line appended to ``metrics/mlflow-<process>.jsonl`` (in the
  agent's own folder of the placement, out of the script's reach) before
  the answer is sent (the reporter ships those lines like ``torchyard.run.log_metric``'s,
  keyed by name, rank, step and ``occurrence``, so an API outage or a retried batch loses
  or doubles nothing). A point keeps its step; several values at one step of a name and
  rank (MLflow's history keeps them all) are told apart by their ``occurrence`` there, 0,
  1..., counted here in the order they were logged. Only a metric sent without a step
  takes the next step above the highest one so far. Non-finite values are kept in the
  run's history here but not shipped (the metrics API holds finite numbers);
* params, tags, the runs and MLflow 3's logged models are the file ``tracking.json``
  (rewritten whole on each change; the reporter sends it when it changed), shown as the
  job's ``tracking``;
* a run's ``artifact_uri`` is a folder under the node's outputs
  (``outputs/mlflow/<run id>/artifacts``), so ``mlflow.log_artifact(s)`` copies files there
  itself and they are part of the job's outputs archive; so is a logged model's
  (``outputs/mlflow/models/<model id>/artifacts``).

``GET /`` (where MLflow's "View run" links lead: their ``#/...`` stays in the browser) is a
page saying that there is no web UI here and where the job's data are; the processes also
get ``MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT`` so that the client prints no such link.

Errors are MLflow's: ``{"error_code": "INVALID_PARAMETER_VALUE", "message": ...}`` with a
4xx status for bad input, ``RESOURCE_DOES_NOT_EXIST`` (404) for an unknown run or
experiment, ``ENDPOINT_NOT_FOUND`` (404) for a call it does not serve.

Connections cost the node's agent a thread each, so an endpoint holds at most
:data:`~.server.MAX_CONNECTIONS` at once: a further one waits (it and those behind it in the listen
backlog) until one ends, and the connection idle the longest (waiting for its first or next
request) is closed at once to make room; MLflow's client opens a new one for its next call.
A connection that sends nothing for :data:`~.server.CONNECTION_TIMEOUT_S`, between requests or within
one, is closed without an answer.

The modules: :mod:`.server` (the HTTP server, its connections, reading and answering a
request, and :class:`~.server.TrackingEndpoint`, what a placement starts), :mod:`.calls`
(which MLflow call does what), :mod:`.fields` (each request field checked as MLflow checks
it), :mod:`.store` (the runs, experiments and logged models of the placement, and the files
they reach the reporter through), :mod:`.records` (what is kept of a run, a logged model, a
process), :mod:`.model_search` (the filter and order of a search of logged models) and
:mod:`.ranks` (which rank a ``per_node`` caller is).
"""
