"""`python -m specpilot ...`: the `specpilot` command (`specpilot.cli.main`)."""
import sys

from specpilot.cli import main

if __name__ == "__main__":
    sys.exit(main())
