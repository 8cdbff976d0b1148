"""`python -m bench [args]` in a checkout = `python -m fusedops.bench [args]`."""

import sys

from fusedops.bench.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
