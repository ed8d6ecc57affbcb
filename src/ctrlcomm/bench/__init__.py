"""``ctrlcomm bench``: an OSU-style latency suite over real ranks, and the other systems it
compares with.

- ``_measure``: what a rank measures (the ops, their payloads, the timed loops), shared by
  every system a run compares;
- ``_run``: local and multi-host runs, the summary, the table, the JSON and the plot;
- ``_baselines``: the other systems (gloo, MPI, vLLM's store-based group, Megatron's star);
- ``_mpi``: a rank of the MPI baseline, started by ``mpiexec``;
- ``_cli``: the ``ctrlcomm bench`` command line.
"""
