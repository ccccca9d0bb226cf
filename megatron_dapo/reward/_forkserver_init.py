"""Preloaded by the reward pool's forkserver only (`pool.WorkerPool`): SIGTERM is ignored there.

SLURM's time-limit and preemption signal goes to every process of a job step, the forkserver and
the reward workers included. The trainer handles it (checkpoint, exit 143) and needs its reward
workers until then; a dead forkserver would also take its workers down (they exit when orphaned).
Ignoring SIGTERM here leaves the decision to the trainer: the pool is stopped by the trainer
(SIGKILL on timeouts, a None message at close) or when the trainer's end closes the forkserver's pipe.
Never import this module anywhere else: it changes the importing process's signal disposition.
"""

import signal
import threading

if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
