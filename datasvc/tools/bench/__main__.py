import sys

from datasvc.tools.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
