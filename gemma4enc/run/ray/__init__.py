"""--engine ray: the local pipeline (decode → tower → shard writer) in a pool of Ray actors.

Four modules, one job each:
- cluster.py talks to Ray the system: joining a cluster (or starting a private one) with every
  wait bounded, planning the actor pool from its resources, timing the first actor's start;
- driver.py is this process's side: rounds of tasks, the rows into OUT's manifest, OUT's lock held
  by its caller;
- pool.py is the driver's actor pool: actors started, fed one task each, replaced when they die,
  tasks retried a bounded number of times, every wait bounded and reported;
- actor.py is what runs on Ray's workers: the tasks and the actor that encodes them; it imports
  neither of the other two.

The engine's face is `encode(todo, run)`, as every engine's (run/context.py).
"""

from .driver import ROUND_FILES, encode

__all__ = ["ROUND_FILES", "encode"]
