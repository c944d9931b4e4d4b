"""``python -m bloomery_jax.serve``: the OpenAI-compatible server (see bloomery_jax/server/)."""

import sys

from .server.cli import main

if __name__ == "__main__":
    sys.exit(main())
