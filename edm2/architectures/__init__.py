"""Every network family this edm2 knows: importing this package registers them all (edm2.families).

What loads, trains or counts a network named in a file imports this package, so that the family a snapshot names
is registered whichever modules the program imported before. A family registers itself at the end of its own
module; the line that imports that module here is its registration.
"""

from edm2 import networks  # noqa: F401  (the release's U-Net, 'edm2')
from edm2.architectures import mp_resnet  # noqa: F401  (docs/extending.md's example, 'mp-resnet')
from edm2.architectures import ladder  # noqa: F401  (the paper's CONFIG B to E: 'config-b' .. 'config-e')
from edm2.architectures import config_f  # noqa: F401  (the paper's CONFIG F: 'config-f')
