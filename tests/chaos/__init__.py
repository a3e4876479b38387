"""Chaos suite: randomised fault scenarios against real processes and files.

* :mod:`.dataset` - a dataset whose samples say what produced them, and faults armed from outside;
* :mod:`.scenario` - a scenario drawn from a seed: settings, runs and faults;
* :mod:`.trainer` - one training run, a child process (``python -m tests.chaos.trainer SPEC``);
* :mod:`.faults` - what a run does to itself and its store (bit flips, a full disk);
* :mod:`.runner` - runs a scenario's training processes, waits with deadlines, collects the evidence;
* :mod:`.checks` - what must hold after a scenario;
* ``python -m tests.chaos`` (``make chaos``) - many scenarios and the table of fault x outcome.

``CHAOS_SEED`` (first scenario's seed; scenario ``i`` uses ``CHAOS_SEED + i``) and
``CHAOS_N`` (how many) reproduce and size a run.
"""
