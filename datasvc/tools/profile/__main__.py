import sys

from datasvc.tools.cli import main

sys.exit(main(["profile", *sys.argv[1:]]))
