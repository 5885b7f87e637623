"""python -m tilefuse.validate: see tilefuse/validate/__init__.py."""
import sys

from tilefuse.validate import main

sys.exit(main())
