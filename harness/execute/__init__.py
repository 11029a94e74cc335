"""Processes: job files (``jobs``), the worker that runs one cell (``worker``), local ranks (``local``, over
the loopback launcher ``local_ranks``), the executors of a sweep (``executors``: debug, local, Slurm) and
the environment of a Slurm task (``slurm``)."""
