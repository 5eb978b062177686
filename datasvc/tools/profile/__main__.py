import sys

from datasvc.tools.profile.cli import main

sys.exit(main())
