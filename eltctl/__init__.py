"""eltctl: elastic PyTorch training over SSH on the machines a lab already has.

This package is the control side. It must never import torch: `eltctl --help`
and every control command start in well under a second.
"""

__version__ = "0.1.0"
