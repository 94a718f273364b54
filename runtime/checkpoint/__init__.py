"""Checkpoints on a worker's local disk: atomic, self-verifying, loadable
without eltctl. Standard library only at import (torch on first use): the
control side's mirror reads and copies them.
"""
