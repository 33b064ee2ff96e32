"""Upkeep: what happens when nobody reports, run by every API replica's reaper
(:mod:`.reaper`) every ``reaper_interval_s``, one module per duty:

1. :mod:`.leases`: placements whose lease expired are done; their live attempt fails with
   ``WorkerLostError`` naming the node ("node X stopped heartbeating"), and the job is
   restarted (back to ``queued``) or fails, as ``resources.max_restarts`` says;
2. :mod:`.nodes`: ready nodes silent for ``lease_timeout_s`` are ``lost``, and their
   placements go the same way;
3. :mod:`.cancellations`: a cancelling job whose remaining placements were never claimed
   (no process to stop) or are all done becomes ``cancelled``;
4. :mod:`.timeouts`: a running job past its ``resources.max_runtime_s`` fails with
   ``TimeoutError``; its nodes stop their ranks at their next heartbeat;
5. every running hyperparameter sweep takes its decisions (prunes trials, queues the next
   ones, ends when its last trial does; see :mod:`service.services.sweep_rounds`);
6. a scheduling pass runs when jobs are queued (asked of the replica's scheduling loop,
   :mod:`service.services.scheduler_loop`, when the reaper runs inside the API).

:func:`.upkeep_pass.run_upkeep_pass` runs them in that order, with the removal of ended
jobs' checkpoint files and the retention of finished jobs. Each job is handled in a
transaction of its own under its row lock and re-checked there, so replicas doing the
same pass at the same time are harmless: the second one finds nothing left to do.

Duties 1 and 2 judge silence, and silence means something only while somebody was
listening (:mod:`.listening`).
"""
