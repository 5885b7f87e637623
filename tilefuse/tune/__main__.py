"""python -m tilefuse.tune: see tilefuse/tune/__init__.py."""
import sys

from tilefuse.tune import main

sys.exit(main())
