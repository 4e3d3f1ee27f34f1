"""``python -m dynapipe``: the command line."""
import sys

from dynapipe.cli import main

if __name__ == "__main__":
    sys.exit(main())
