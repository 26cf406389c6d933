"""`python -m moecore.bench ...` runs `moecore bench ...`."""

import sys

from moecore.bench import main

sys.exit(main())
