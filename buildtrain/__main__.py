"""`python -m buildtrain` is `bt`."""

import sys

from buildtrain.cli import main

sys.exit(main())
