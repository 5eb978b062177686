"""``python -m trainer.bench``: the GPU training cases (``trainer.bench.training``);
``python -m trainer.bench peers ...``: side by side with the stock paths (``trainer.bench.peers``)."""
import sys

if sys.argv[1:2] == ["peers"]:
    from trainer.bench.peers import main

    sys.exit(main(sys.argv[2:]))

from trainer.bench.training import main

sys.exit(main())
