"""`python -m dse.cli`, as the `dse` script."""

import sys

from dse.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
