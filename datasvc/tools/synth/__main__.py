import sys

from datasvc.tools.synth.cli import main

sys.exit(main())
