"""The shared runner, where the specification puts it: the training loop of every env and algorithm.

* :mod:`.runner` — ``Runner``: one iteration's named phases (collect, advantages, update, log, keep_best,
  checkpoint, evaluate), resume and preemption;
* :mod:`.collector` — plays the parallel envs turn by turn (:mod:`.turns`) into the rollout buffer (:mod:`.buffer`);
* :mod:`.evaluation` — held-out episodes;
* :mod:`.checkpoint`, :mod:`.best`, :mod:`.preemption`, :mod:`.storage`, :mod:`.diagnostics` — what the loop
  keeps, notices and logs.

Nothing is imported here: the buffer sits below the trainers (``marft.algorithms``), the loop above them.
"""
