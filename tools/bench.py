#!/usr/bin/env python
"""kvstore benchmarks: each figure beside its physical limit and a peer, as ratios.

    python tools/bench.py [--quick] [--section memory --section disk ...] [--json out.json]

Same as ``kvstore bench``.
"""

import sys

from kvstore.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
