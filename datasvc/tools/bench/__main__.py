import sys

from datasvc.tools.bench.cli import main

sys.exit(main())
