"""``python -m testbed up|down ...``: the test cluster's command line (testbed/cli.py)."""

import sys

from testbed.cli import main

sys.exit(main())
