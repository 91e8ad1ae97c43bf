"""`python -m eagle3_jax.bench`: the benchmark (also the peer's child process)."""

import sys

from eagle3_jax.bench.main import main

sys.exit(main())
