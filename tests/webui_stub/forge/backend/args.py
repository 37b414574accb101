"""``backend/args.py``: Forge 2's own flags (``--always-cpu`` ...), parsed apart from A1111's."""

import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--always-cpu", action="store_true")
args = parser.parse_known_args([])[0]
