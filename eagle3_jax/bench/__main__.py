"""`python -m eagle3_jax.bench`: the benchmark (also the peer's child process), as `eagle3-jax bench`."""

import sys

from eagle3_jax.arguments import PROG, run_command
from eagle3_jax.bench.main import main

sys.exit(run_command(f"{PROG} bench", lambda: main(sys.argv[1:])))
