"""eltctl: elastic PyTorch training over SSH on the machines a lab already has.

This package is the control side. It must never import torch: `eltctl --help`
and every control command start in well under a second.
"""

__version__ = "0.1.0"

import warnings as _warnings

# cryptography 51 deprecates DSA, and asyncssh (2.24) touches its DSA classes on import: a
# CryptographyDeprecationWarning (a UserWarning) per name on stderr of every command, cron's
# silent runs included. eltctl never offers or accepts DSA keys; the warning says nothing to
# its users, so it is not shown.
_warnings.filterwarnings("ignore", message=r"DSA is deprecated", category=UserWarning, module=r"asyncssh(\.|$)")
