"""`python -m moecore ...` (and `torchrun -m moecore ...`) runs the command line."""

from moecore.cli import entry

entry()
