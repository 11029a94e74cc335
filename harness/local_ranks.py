"""``python -m harness.local_ranks --nproc-per-node=N [-m] MODULE_OR_SCRIPT [ARGS...]``: where users type it.
The launcher is :mod:`harness.execute.local_ranks`."""

from harness.execute.local_ranks import main

if __name__ == "__main__":
    raise SystemExit(main())
