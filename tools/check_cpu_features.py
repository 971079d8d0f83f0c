#!/usr/bin/env python3
"""Same report as `python -m ktfp8.cpu`: CPU flags, OS support, compiled variants, usable backends."""
import sys
from pathlib import Path

try:
    from ktfp8.cpu import main
except ImportError:  # run from a source checkout that was built in place
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from ktfp8.cpu import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
