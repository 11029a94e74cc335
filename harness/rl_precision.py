"""``python -m harness.rl_precision TRACE_DIR [--step N]``: where users type it. The program is
:mod:`harness.rl.precision`."""

from harness.rl.precision import main

if __name__ == "__main__":
    main()
