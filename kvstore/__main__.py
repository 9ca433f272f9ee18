"""``python -m kvstore``: the ``kvstore`` command (:func:`kvstore.cli.main`)."""

import contextlib
import sys

from kvstore.cli import main

with contextlib.suppress(BrokenPipeError):  # `kvstore nodes | head`: no traceback
    sys.exit(main())
