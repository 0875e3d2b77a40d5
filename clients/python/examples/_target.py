"""Where the examples find the server: argv[1], $TRACEWIRE_TARGET, or 127.0.0.1:50051."""

import os
import sys


def target() -> str:
    return sys.argv[1] if len(sys.argv) > 1 else os.environ.get("TRACEWIRE_TARGET", "127.0.0.1:50051")
