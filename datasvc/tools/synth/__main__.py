import sys

from datasvc.tools.cli import main

sys.exit(main(["synth", *sys.argv[1:]]))
