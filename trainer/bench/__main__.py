"""``python -m trainer.bench``: the GPU training cases (``trainer.bench.training``)."""
import sys

from trainer.bench.training import main

sys.exit(main())
