"""`python -m eagle3_jax.bench`: the benchmark (also the peer's child process), as `eagle3-jax bench`."""

import sys

from eagle3_jax.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
