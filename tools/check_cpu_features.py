#!/usr/bin/env python3
"""Same report as `python -m ktfp8.cpu`: CPU flags, OS support, compiled variants, usable backends."""
import sys

from ktfp8.cpu import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
