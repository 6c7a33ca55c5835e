"""`python -m pagecli`."""

import sys

from pagecli.cli import main

sys.exit(main())
