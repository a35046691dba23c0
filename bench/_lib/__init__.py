"""Shared parts of the benchmarks; the commands (``python -m bench.<name>``) are thin files
over these.

* ``models``: the bench MLP and GPT, the DP x TP MLP, the ``transformers`` models, batches, loss;
* ``modes``: the data-parallel paths compared (:class:`modes.Mode`), and the floors;
* ``step``: one training step, and the one worker (rank functions) that builds a job,
  warms it up, times, profiles and dumps its parameters;
* ``jobs``: the parent's side: a job per (model, mode, cap) on a kept-alive
  ``ddp_fusion.launch.RankPool``, compiled once, timed round-robin;
* ``profiling``: profiler helpers: bytes, copies, memory, lowered graphs, time lines;
* ``report``: step-time and bytes tables, the bucket-cap sweep plot;
* ``link``: the shaped-link benchmark (``bench.step_time --link``): the network namespace,
  rates, floors and hidden communication;
* ``timeline``: one profiled step per rank on a time line, and its picture;
* ``comm``: plain all-reduce timings (rank functions) and the alpha-beta fit;
* ``replay``: the cost model's replay of profiled steps with modelled communication;
* ``projection``: the GPU projection (pure functions);
* ``probes``: rank functions of the small commands (plan check, hook order);
* ``record``: ``bench/out/``, the machine and provenance record, byte counts, spreads;
* ``_torch``: every private torch name bench uses.

Rank functions live here, not in a command's module: spawn pickles them by module name,
and under ``python -m bench.<name>`` the command's module is ``__main__``.
"""
