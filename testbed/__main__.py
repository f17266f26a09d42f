"""``python -m testbed up|down ...``: the test cluster's command line (testbed/cluster.py)."""

import sys

from testbed.cluster import main

sys.exit(main())
